"""The engine: loads encoders into a backend and runs padded batches on them."""
