"""Build-time code: CPU fallbacks, calibration, ONNX export and TensorRT builds."""
