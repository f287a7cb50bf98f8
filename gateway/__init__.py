"""berth's public front door: the berth.v1 API over gRPC."""
