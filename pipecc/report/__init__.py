"""What pipecc shows people. Modules, each importing only those listed before it:

    formatting   numbers, durations, shapes and plain-text tables as every view writes them
    figures      figures read off a plan: bottleneck stage, device capacities
    tables       `pipecc cost` output            text        `pipecc plan` output
    artifacts    OUT/graph.json and OUT/timeline.json, and `timeline_for(plan)`
    compiled     a compiled folder read back: `pipecc inspect` text and JSON
    dot          Graphviz views (`pipecc inspect --format dot`)
    svg          the report's charts             html        OUT/report.html
    stage_onnx   per-stage ONNX export (`pipecc inspect --onnx`)
"""
