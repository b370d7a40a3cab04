"""``hyper_parallel.core.pipeline_parallel``: upstream's pipeline stages and schedules on
hp-mpmd."""

from hyper_parallel.core.pipeline_parallel.scheduler import (
    PipelineScheduleRuntime,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage

__all__ = [
    "PipelineScheduleRuntime",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
]
