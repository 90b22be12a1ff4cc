"""pipecc.backends: code generation behind one interface (`base.Backend`): `torch` (readable
stage files, the compiled folder, the drop-in module) and `fpga` (Vitis HLS projects, C
simulation). The driver chooses them per plan. `names` is the one rule both use to turn
human names into identifiers."""
