"""What pipecc shows people: cost and plan tables (`tables`, `text`), the compiled folder's
inspection and graph views (`compiled`), the HTML report (`html`) and per-stage ONNX export
(`stage_onnx`)."""
