"""The prefix benchmark: engines with a prefix cache, conversations, gateway processes.

``workload`` (the conversations with and without shared prefixes, and the load rule),
``fleet`` (the engines and ``PrefixConfig``), ``policies`` (how a gateway chooses),
``gateway`` (one gateway process: an OpenAI-compatible proxy), ``driver`` (the
conversations sent through the gateways), ``report`` (figures, targets, the table) and
``run`` (``run_prefix``, what ``poller bench --section prefix`` calls).
"""
