"""The Endpoint Picker (`kvserve epp`): Envoy's ext_proc gRPC service that picks a replica per
request with the router's own scoring, for gateways of the Gateway API Inference Extension."""
