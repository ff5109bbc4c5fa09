"""The routers people run instead of the picker, in the routing family's cells.

``install`` (each router at its pin from constraints/peers.txt, in a private virtual
environment), ``routers`` (the peers, their command lines, starting and stopping them)
and ``run`` (``run_peers``, what ``poller bench --section peers`` calls).
"""
