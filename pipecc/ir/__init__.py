"""The IR: the annotated graph and its verifier (`graph`), op classes (`ops`), the plan
(`plan`) and the schedule IR (`schedule`). Importing this package imports nothing heavy:
the runtime uses `pipecc.ir.schedule` without torch.fx or sympy."""
