"""Where a request goes: the routing rules, on the view and the load.

    options.py   RoutingOptions: every routing option, frozen and checked
    index.py     Slot, Bag, ModelIndex, Index: who may take a request, per model
    indexer.py   Indexer: the index of what a pick is given, a cache's kept current
    models.py    the load model: LoadModel and its three implementations
    draw.py      the draws: the better of two, or the least of a few
    pick.py      Pick: one pick's state and the one loop that chooses
    affinity.py  prefix affinity: the endpoint holding the longest prefix, within a bound

It reads the view, the load and the prefix placements, and writes none of them: the
Router (poller/reader/router.py) records what a pick chose.
"""

from poller.reader.routing.options import RoutingOptions, WhenSaturated

__all__ = ["RoutingOptions", "WhenSaturated"]
