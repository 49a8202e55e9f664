"""What each end of a round is handed once per run and never asks about again:
``sealing`` (sealed or clear, both ends) and ``audit`` (a log, or none)."""

from fedciuic.stages.audit import AuditTrail as AuditTrail
from fedciuic.stages.audit import NoAudit as NoAudit
from fedciuic.stages.sealing import Clear as Clear
from fedciuic.stages.sealing import ClearRegion as ClearRegion
from fedciuic.stages.sealing import ClearReplies as ClearReplies
from fedciuic.stages.sealing import Provenance as Provenance
from fedciuic.stages.sealing import RegionSealing as RegionSealing
from fedciuic.stages.sealing import ReplySealing as ReplySealing
from fedciuic.stages.sealing import Sealed as Sealed
from fedciuic.stages.sealing import SealingRegion as SealingRegion
from fedciuic.stages.sealing import aggregator_sealing as aggregator_sealing
