"""What the gateway replicas share through Redis, and when.

    wire.py      how long what is shared lasts and is trusted (contracts between replicas)
    pacer.py     when a call may go: at once on a change, within a token bucket
    carrier.py   the prefix placements on the same calls
    rights.py    what Redis may refuse the gateway's user, and how it is said
    exchange.py  Exchange: the share script's calls, the others' totals taken in
    loops.py     run, run_sync: the exchange driven by an asyncio task or a thread

It carries the load (poller/reader/load/) and the placements (poller/reader/prefix/)
of one Router; nothing below it imports it.
"""

from poller.reader.exchange.exchange import Exchange

__all__ = ["Exchange"]
