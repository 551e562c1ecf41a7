"""Tools around the library: ``python -m fastsample bench`` (:mod:`.bench`) and
``python -m fastsample selfcheck`` (:mod:`.selfcheck`). Nothing in the library imports them."""
