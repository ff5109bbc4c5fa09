"""The Endpoint Picker for Envoy: the Gateway API Inference Extension's Endpoint Picker
Protocol over Envoy's ext_proc, served by ``poller epp`` (docs/epp.md).

Installed with the ``epp`` extra (``pip install 'llmgw-poller[epp]'``: grpcio, Envoy's
generated API stubs from xds-protos, grpcio-health-checking). In the order a request
flows:

=================  ==================================================================
``destinations``   registry ids <-> the ``ip:port`` Envoy dials (names resolved)
``body``           the model and the prompt of an OpenAI request body
``picking``        one pick as Envoy's answer, or the refusal the client gets
``messages``       the ext_proc messages, built from Envoy's generated API
``stream``         one ext_proc stream: one request and its response, each body mode
``server``         the gRPC servers: ext_proc, health (liveness, readiness), TLS
``metrics``        the Prometheus metrics
``run``            the process: one Router, the servers, until a signal
=================  ==================================================================
"""

from poller.integrations.envoy.metrics import EppMetrics
from poller.integrations.envoy.run import run_epp
from poller.integrations.envoy.server import EXT_PROC_SERVICE, EppOptions, EppServer

__all__ = ["EXT_PROC_SERVICE", "EppMetrics", "EppOptions", "EppServer", "run_epp"]
