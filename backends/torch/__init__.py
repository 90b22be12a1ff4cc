"""The torch backend: cut the annotated graph into stages, write readable stage files, run them.

    stages.py         cut_stages(graph, stage_of) -> [Stage]: fx GraphModules over the original
                      weights, with the ports (values) each receives and sends
    codegen.py        emit_stage_source / write_stage: a standalone `stage.py` per stage
    inplace.py        written_inputs: the received values a stage writes in place (it works on
                      copies of them); check_in_place: such writes the stages cannot reproduce
    render.py, lower_modules.py, names.py
                      how graph nodes become safe, readable torch code
    manifest.py       which files of OUT pipecc wrote: the marker's list with a keyed hash per file
    compile.py        write_output: the compiled folder OUT, atomically; pipelined_module: the
                      in-memory drop-in module over a model's own parameters
    backend.py        TorchBackend: the above behind the driver's Backend interface

Loading compiled stages and the drop-in module live in `pipecc.runtime` (which never imports
this package); `load_stage` is re-exported here for convenience.
"""

from pipecc.backends.torch.backend import TorchBackend
from pipecc.backends.torch.codegen import emit_stage_source, generate_stage, load_stage, write_stage
from pipecc.backends.torch.compile import pipelined_module, write_output
from pipecc.backends.torch.stages import Port, Stage, cut_stages, normalise_stage_of, ports_json

__all__ = ["Port", "Stage", "cut_stages", "emit_stage_source", "generate_stage", "load_stage",
           "normalise_stage_of", "pipelined_module", "ports_json", "TorchBackend", "write_output",
           "write_stage"]
