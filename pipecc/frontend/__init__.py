"""Frontends: a model file (`modelfile`), traced with torch.fx or torch.export
(`torch_capture`), or an ONNX file (`onnx_import`, with the torch implementations of ONNX
operators in `onnx_ops`), each into one annotated graph (`pipecc.ir.graph`)."""
