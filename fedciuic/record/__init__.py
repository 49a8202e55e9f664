"""A run's ``metrics.json``: its schema (``metrics``, what ``ops/`` reads) and its
writer (``recorder``)."""

from fedciuic.record.metrics import OVERALL as OVERALL
from fedciuic.record.metrics import EvalEntry as EvalEntry
from fedciuic.record.metrics import MetricsError as MetricsError
from fedciuic.record.metrics import PolicyHeld as PolicyHeld
from fedciuic.record.metrics import ResumedFrom as ResumedFrom
from fedciuic.record.metrics import Rounds as Rounds
from fedciuic.record.metrics import RunHeader as RunHeader
from fedciuic.record.metrics import RunMetrics as RunMetrics
from fedciuic.record.metrics import RunStatus as RunStatus
from fedciuic.record.metrics import TrainEntry as TrainEntry
from fedciuic.record.metrics import dump_rounds as dump_rounds
from fedciuic.record.metrics import load_metrics as load_metrics
from fedciuic.record.metrics import parse_rounds as parse_rounds
from fedciuic.record.recorder import ADAPTER_DIR as ADAPTER_DIR
from fedciuic.record.recorder import METRICS_FILE as METRICS_FILE
from fedciuic.record.recorder import SUMMARY_FILE as SUMMARY_FILE
from fedciuic.record.recorder import RunRecorder as RunRecorder
from fedciuic.record.recorder import no_aggregate_reasons as no_aggregate_reasons
from fedciuic.record.recorder import published_rounds as published_rounds
from fedciuic.record.recorder import save_metrics as save_metrics
from fedciuic.record.recorder import utc_now as utc_now
