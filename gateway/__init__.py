"""berth's public front door: the berth.v1 and KServe v2 APIs over gRPC."""
