"""The volunteer's side of the staged pipeline: cutting a model into stages, and the stage worker.

A pipeline run trains a model larger than any one volunteer's memory: the model is cut into K
stages of consecutive layers, each a contiguous range of the run's flat parameter vector, and a
worker builds, holds and trains only its own stage (the design notes: the heterogeneous
pipeline with a parameter server per stage and a task pool).

* :mod:`toolkit.pipeline.cuts`: where a model's parts lie in the flat vector
  (:class:`PipelineUnits`) and how layers are dealt to stages (:func:`cut_stages`), as pure data;
* :mod:`toolkit.pipeline.stage`: :class:`Stage`, one stage as a module (inputs, forward to the
  boundary, loss on the last stage), with one subclass per architecture it can cut
  (:mod:`toolkit.pipeline.byte` for the toolkit's ByteTransformer, :mod:`toolkit.pipeline.decoder`
  for transformers' decoders, whose families -- GPT-2, Llama / Qwen, Mistral, GPT-NeoX -- are the
  table in :mod:`toolkit.pipeline.families`);
* :mod:`toolkit.pipeline.stages`: :func:`pipeline_units` (and its refusals) and
  :func:`build_stage`, which builds a stage without ever materialising the full model;
* :mod:`toolkit.pipeline.compute`: what a task computes on a stage -- its forward with the
  micro-batch's dropout masks under the run's precision, and a backward replaying that forward;
* :mod:`toolkit.pipeline.boundary_codec`: the one-process model a run with a lossy boundary codec
  equals (the codec's round trip at every cut, forward and backward);
* :mod:`toolkit.pipeline.batch_data`: a micro-batch's data on the wire (what a first-stage result
  sends, and the data a replayed first-stage task carries, validated).

All but the worker are in the shared layer (:mod:`toolkit`): the relay cuts the same stages. The
stage worker (:mod:`toolkit.pipeline.worker`), which talks to the relay, is a peer-side unit.
"""

from toolkit.pipeline.cuts import PipelineUnits, StageCut, cut_stages
from toolkit.pipeline.stage import Stage
from toolkit.pipeline.stages import build_stage, meta_model, pipeline_units, units_of

__all__ = [
    "PipelineUnits",
    "Stage",
    "StageCut",
    "build_stage",
    "cut_stages",
    "meta_model",
    "pipeline_units",
    "units_of",
]
