"""What the tests share: real servers started on free loopback ports (redis-server,
Cluster, Sentinel, dnsmasq), the scripted HTTP server, a TCP proxy that injects faults,
process helpers, the headless browser, the LiteLLM fleet, and the paths of the tree."""
