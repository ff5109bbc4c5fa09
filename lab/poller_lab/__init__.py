"""The lab: simulated engines, the demo, the benchmarks and the soak run of llmgw-poller.

Not part of the product (see lab/README.md): it imports the poller, the poller never
imports it. Its commands (`poller demo|sim|bench|soak`) come in through entry points."""
