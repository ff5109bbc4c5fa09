"""What the gateway replicas share through Redis, and when.

    wire.py      how long what is shared lasts and is trusted (contracts between replicas)
    pacer.py     when a call may go: at once on a change, within a token bucket
    carrier.py   the prefix placements on the same calls
    exchange.py  Exchange: the share script's calls, the others' writes taken in

It carries the load (poller/reader/load/) and the placements (poller/reader/prefix/)
of one Router; nothing below it imports it.
"""

from poller.reader.exchange.exchange import Exchange

__all__ = ["Exchange"]
