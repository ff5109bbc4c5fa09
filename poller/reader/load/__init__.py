"""What the gateway replicas have in flight: this replica's own and the fleet's.

    local.py  LocalLoad: this replica's requests in flight, their times and failures
    others.py Others: the other replicas' requests in flight, summed per endpoint
    fleet.py  FleetLoad: the estimate a pick adds up (the others' + ours + outside)

It reads nothing of Redis: the exchange (poller/reader/exchange/) carries the counts.
"""

from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad

__all__ = ["FleetLoad", "LocalLoad"]
