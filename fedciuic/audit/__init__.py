"""The tamper-evident record: each party's hash-chained, signed log and its verifier
(``log``), and the per-run compliance report cross-checking the parties' logs
(``report``)."""

from fedciuic.audit.events import LEDGER_WITNESSES as LEDGER_WITNESSES
from fedciuic.audit.events import OUTSIDE_DP as OUTSIDE_DP
from fedciuic.audit.events import SECURE_SENT_EVENTS as SECURE_SENT_EVENTS
from fedciuic.audit.events import SENT_EVENTS as SENT_EVENTS
from fedciuic.audit.events import Event as Event
from fedciuic.audit.log import AGGREGATOR_LOG as AGGREGATOR_LOG
from fedciuic.audit.log import RECEIVED_EVENT as RECEIVED_EVENT
from fedciuic.audit.log import REGION_LOG as REGION_LOG
from fedciuic.audit.log import AuditError as AuditError
from fedciuic.audit.log import AuditLog as AuditLog
from fedciuic.audit.log import checkpoint_head as checkpoint_head
from fedciuic.audit.log import code_version as code_version
from fedciuic.audit.log import config_hash as config_hash
from fedciuic.audit.log import digest as digest
from fedciuic.audit.log import load_records as load_records
from fedciuic.audit.log import redaction as redaction
from fedciuic.audit.log import verify as verify
from fedciuic.audit.log import with_carried as with_carried
from fedciuic.audit.report import PartyLog as PartyLog
from fedciuic.audit.report import Section as Section
from fedciuic.audit.report import build_report as build_report
from fedciuic.audit.report import check_and_report as check_and_report
from fedciuic.audit.report import html_sections as html_sections
from fedciuic.audit.report import html_table as html_table
from fedciuic.audit.report import open_logs as open_logs
from fedciuic.audit.report import verify_logs as verify_logs
from fedciuic.audit.report import write_sections as write_sections
from fedciuic.audit.retention import enforce_at_start as enforce_at_start
from fedciuic.audit.retention import prune_log as prune_log
