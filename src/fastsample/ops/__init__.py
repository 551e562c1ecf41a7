"""Pure torch ops: the CPU path, and the reference every other backend is tested against.

Each module is one concern, built from elementwise ops and per-row reductions, with no host
sync and fixed shapes:

* ``race``, ``inverse_cdf``: the two exact draw algorithms (exponential race; blocked
  inverse CDF over float64 block sums);
* ``weights``: the one formula of weights from logits or probabilities and temperature;
* ``cuts``: the top-k, top-p and min-p thresholds and applying them;
* ``select``: exact order statistics (radix thresholds, block maxima, first argmax);
* ``small_top_k``: sampling under a small static ``top_k`` from the ``k`` best blocks only;
* ``philox``, ``seeds``, ``noise``: counter-based randomness and the one interface through
  which random numbers enter;
* ``pieces``: row pieces sized to the cache; ``validation``: every argument check.

Nothing here imports from the layers above (:mod:`fastsample.sampling`, ``controls``,
``verify``, ``distributed``, ``kernels``, ``tools``); ``tests/test_layout.py`` checks it.
"""
