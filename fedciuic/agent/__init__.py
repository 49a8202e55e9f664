"""The region agent: the region's own process, the only one that holds its data, keys,
ledger, policy and audit log (docs/cluster.md). Flower's ClientApp, which the
aggregator ships, relays to it over :mod:`fedciuic.agent.channel`.
"""

from fedciuic.agent.channel import HELLO as HELLO
from fedciuic.agent.channel import HELLO_RECORD as HELLO_RECORD
from fedciuic.agent.channel import HELLO_REGION as HELLO_REGION
from fedciuic.agent.channel import ChannelError as ChannelError
from fedciuic.agent.channel import Frame as Frame
from fedciuic.agent.channel import Scalar as Scalar
from fedciuic.agent.channel import ask as ask
from fedciuic.agent.config import AgentConfig as AgentConfig
from fedciuic.agent.service import AgentError as AgentError
from fedciuic.agent.service import hello as hello
from fedciuic.agent.service import serve as serve
