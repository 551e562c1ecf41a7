"""Speculative-decoding verification, chain and tree, exact in distribution.

A draft model proposes tokens; the target model scores all of them in one forward pass;
the verifier decides which drafts to keep and draws one more token, so that the emitted
tokens are distributed exactly as if they had been sampled from the target alone.

Chain (:func:`verify_chain`), for drafts ``x_1..x_K`` with target distributions
``p_1..p_{K+1}`` and draft distributions ``q_1..q_K``:

1. Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``, tested as
   ``u_i * q_i(x_i) < p_i(x_i)`` in float64 with ``u_i`` a 53-bit uniform in ``[0, 1)``.
   The comparison is strict, so a token with ``p_i(x_i) = 0`` is never accepted (not even
   for ``u_i = 0``), and no division is needed.
2. Stop at the first rejection ``j``: emit ``x_1..x_{j-1}`` and one token drawn from the
   residual ``max(p_j - q_j, 0)`` renormalized. If all drafts are accepted, emit them and
   a bonus token drawn from ``p_{K+1}``.

Why it is exact (Leviathan et al. 2023; Chen et al. 2023): at one position, the emitted
token is ``x`` with probability ``q(x) min(1, p(x)/q(x)) = min(p(x), q(x))`` through
acceptance, plus ``P(reject) r(x)`` with ``P(reject) = 1 - sum_y min(p(y), q(y)) =
sum_y max(p(y) - q(y), 0)`` and ``r`` the normalized residual: the sum is
``min(p, q) + max(p - q, 0) = p``. The next position is then reached only after an
acceptance, with the target's conditional distribution given the accepted prefix, so by
induction the emitted sequence follows the target. It needs ``q`` to be exactly the
distribution the draft token was drawn from (after the draft's own temperature, top-k,
top-p: the *processed* distribution) and the acceptance uniforms to be independent of the
draft's randomness (separate streams, see below).

Drafts without probabilities (n-gram, greedy or lookup drafters): pass
``draft_probs=None``. The draft is then a point mass, ``q = 1`` on ``x``: accept with
probability ``p(x)``, otherwise draw from ``p`` with ``x`` removed. Exact for any way of
choosing the drafts, as long as it does not look at the acceptance uniforms.

Trees (:func:`verify_tree`), for token trees as EAGLE, Medusa and SpecInfer build them:
walk from the root; at the current node, test its children one after the other (siblings
in node order); an accepted child becomes the current node; when every child of the
current node is rejected (or it has none), draw the final token there. Two rules for the
children, each exact under its own assumption about how the children were drafted:

(a) ``draft_probs=None`` ("deterministic children", e.g. the top-k of the draft as in EAGLE
    and Medusa): child ``t`` is accepted with the target's probability among the tokens not
    yet rejected, ``p(t) / (1 - sum of p over rejected siblings)``, and the final token is
    drawn from ``p`` with the rejected siblings removed. This is sampling from ``p`` by
    sequential inversion ("is it t_1? if not, is it t_2? ..."), so it is exact for *any*
    tree, whatever chose its tokens (top-k, sampling, heuristics), as long as the choice
    does not depend on the acceptance uniforms. It never looks at the draft's probabilities.
(b) ``draft_probs`` given ("children drawn without replacement", e.g. SpecTr/RSD-style
    trees): the children of a node were drawn one after the other from the node's draft
    distribution ``q`` *without replacement* (each sibling from ``q`` renormalized over the
    tokens not yet drawn). Recursive rejection sampling: child ``t`` is accepted with
    probability ``min(1, p(t) / q(t))``; after a rejection ``p <- norm(max(p - q, 0))`` and
    ``q <- q`` with ``t`` removed, renormalized; if all children are rejected the final token
    is drawn from the last ``p``. Each step is one speculative-sampling step whose proposal
    is distributed as the current ``q`` given the rejected siblings, so by induction the
    output follows ``p``. It is exact only for that drafting scheme: not for top-k children
    (use (a)) and not for children drawn *with* replacement (i.i.d.), where the draft
    distribution would have to stay unchanged after a rejection. With one child per node it
    is exactly :func:`verify_chain`.

Randomness: every uniform comes from an explicit source. With ``seed`` (and ``step``), row
``b`` uses the counter-based generator of :mod:`fastsample.ops.seeds` with its own
``(seed[b], step[b])`` and three streams: ``Stream.ACCEPT`` (one uniform per draft position
or tree node, counter = position, so a position's uniform never depends on ``K`` or the
batch), ``Stream.RECOVERY`` (the draw after a rejection) and ``Stream.BONUS`` (the draw when
nothing was rejected). Give the draft model's sampler a different stream (``Stream.DRAFT``)
or step: the acceptance uniforms must be independent of the draft tokens. With a
``torch.Generator`` (or neither) the uniforms are drawn in one ``torch.rand`` call.

Cost: the acceptances only read the gathered ``p(x)``, ``q(x)`` (``(B, K)``); the first
rejection is found with a cumulative product; one ``(B, V)`` row per request is read (the
target, and the draft for the residual, at the first rejection or the bonus position) and
drawn from with the blocked inverse CDF of :mod:`fastsample.ops.inverse_cdf`
(:mod:`fastsample.verify.draw`). Residuals are never built for the other positions. Tree
mode (a) costs the same. Tree mode (b) needs the mass of the current residual at every tested
child, one read of the current node's two rows per step, but never updates ``(B, V)``
distributions: after ``i`` rejections at a node with target ``p`` and draft ``q``, the current
target is ``max(p - c_i q, 0)`` renormalized, with one number ``c_i`` per row
(``c_1 = 0``, ``c_{i+1} = c_i + W_i / Q_i``, ``W_i`` its mass and ``Q_i`` the draft mass not yet
drawn), except at the rejected siblings, whose weights stop changing once they leave ``q``
(induction on ``max(max(p - c q, 0) / W - q / Q, 0) = max(p - (c + W / Q) q, 0) / W``).
So every acceptance ratio is computed from the original rows, with exact masses (rows need
not be normalized), and no error accumulates from step to step.

No host sync, no data-dependent shapes, no device asserts: loops run over static counts
(positions, tree nodes, row pieces), so everything compiles with
``torch.compile(fullgraph=True)`` and captures in a CUDA graph. Bad input is handled as in
the samplers: argument errors raise before any work; bad values give ``valid=False`` for
their row only, and ``check=True`` (which syncs) raises instead.

Layout of the package (imports point down this list, never up):

* :mod:`~fastsample.verify.chain`: :func:`verify_chain` and :class:`VerifyOutput`.
* :mod:`~fastsample.verify.tree`: :class:`TokenTree`, the tree walk tables (cached on the
  device for shared host trees), :func:`verify_tree` and :class:`TreeVerifyOutput`.
* :mod:`~fastsample.verify.acceptance`: the acceptance tests of both, on gathered values.
* :mod:`~fastsample.verify.draw`: the one ``(B, V)`` draw at the end (blocked inverse CDF).
* :mod:`~fastsample.verify.checks`: argument checks and the ``check=True`` value checks.
* :mod:`~fastsample.verify.randomness`: the acceptance, recovery and bonus uniforms.
"""

from .chain import VerifyOutput, verify_chain
from .tree import TokenTree, TreeVerifyOutput, verify_tree

__all__ = ["TokenTree", "TreeVerifyOutput", "VerifyOutput", "verify_chain", "verify_tree"]
