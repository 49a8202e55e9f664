"""Everything cryptographic between the parties: X-Wing (``xwing``), the sealed
envelope (``envelope``), key files (``keys``), each party's end of sealing updates and
signing what the aggregator sends (``parties``), and the deployment's TLS and SuperNode
keys (``tls``)."""

from fedciuic.crypto.envelope import EnvelopeRejected as EnvelopeRejected
from fedciuic.crypto.envelope import Suite as Suite
from fedciuic.crypto.keys import NAME_PATTERN as NAME_PATTERN
from fedciuic.crypto.keys import KeyFileError as KeyFileError
from fedciuic.crypto.keys import Keypair as Keypair
from fedciuic.crypto.keys import PublicBundle as PublicBundle
from fedciuic.crypto.keys import bundle_path as bundle_path
from fedciuic.crypto.keys import load_bundle as load_bundle
from fedciuic.crypto.keys import load_bundles as load_bundles
from fedciuic.crypto.keys import load_keypair as load_keypair
from fedciuic.crypto.keys import write_keys as write_keys
from fedciuic.crypto.parties import AGGREGATOR as AGGREGATOR
from fedciuic.crypto.parties import NONCE_BYTES as NONCE_BYTES
from fedciuic.crypto.parties import AggregatorKeys as AggregatorKeys
from fedciuic.crypto.parties import MalformedPayload as MalformedPayload
from fedciuic.crypto.parties import RegionKeys as RegionKeys
from fedciuic.crypto.parties import TaskKind as TaskKind
from fedciuic.crypto.parties import Terms as Terms
from fedciuic.crypto.parties import aggregator_keys as aggregator_keys
from fedciuic.crypto.parties import config_digest as config_digest
from fedciuic.crypto.parties import model_digest as model_digest
from fedciuic.crypto.parties import read_update_payload as read_update_payload
from fedciuic.crypto.parties import region_keys as region_keys
from fedciuic.crypto.parties import reply_message as reply_message
from fedciuic.crypto.parties import sign_global as sign_global
from fedciuic.crypto.parties import sign_run_end as sign_run_end
from fedciuic.crypto.parties import update_payload as update_payload
from fedciuic.crypto.tls import ServerTls as ServerTls
from fedciuic.crypto.tls import generate_server_tls as generate_server_tls
from fedciuic.crypto.tls import generate_supernode_key as generate_supernode_key
from fedciuic.crypto.xwing import CIPHERTEXT_SIZE as CIPHERTEXT_SIZE
from fedciuic.crypto.xwing import PUBLIC_KEY_SIZE as PUBLIC_KEY_SIZE
from fedciuic.crypto.xwing import XWingPrivateKey as XWingPrivateKey
from fedciuic.crypto.xwing import XWingPublicKey as XWingPublicKey
