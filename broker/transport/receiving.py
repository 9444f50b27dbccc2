"""The receiving side of a batch: its signature checked, its rows stored and committed in one
transaction, and the answer acknowledging only what is durable.

The body is PostgreSQL's binary COPY format of broker.transport_message rows, in the wire version its
Content-Type names (broker.transport.wire): it goes straight into a temporary table by COPY, and PostgreSQL's
own input checks refuse anything malformed.  A version 3 batch has no message ids: they stay NULL.
"""
import hashlib
import io
import time
from collections.abc import Mapping
from contextlib import ExitStack

import psycopg2
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DataError, IntegrityError

from broker import queries, tracing
from broker.sessions import with_temporary_table
from broker.transport import signing, wire

# Which secret a peer signs with is written down this often at most (per peer and secret, per process), not with
# every batch: `broker diagnose` reads it (broker.peer_secret_use).
NOTE_SECRET_USE_EVERY_S = 10.0
# When this process last wrote it down, by peer and the secret's SHA-256: only peers whose signature was good.
_secret_use_noted: dict[tuple[str, bytes], float] = {}
# A batch of each wire version into the session's temporary table.
COPY_BATCH = {4: queries.QUERIES["copy_batch_v4"], 3: queries.QUERIES["copy_batch_v3"]}


class Malformed(Exception):
    """The body is not what the endpoint takes; the message says what is wrong with it."""


def secret_of_signer(connection: Connection, peer_instance: str, purpose: str, headers: Mapping[str, str],
                     body: bytes) -> str:
    """The secret this node shares with the peer under which the request is signed for the purpose; raises
    signing.BadSignature when the peer did not sign it so."""
    secrets = connection.execute(queries.QUERIES["secrets_of_peer"], {"instance": peer_instance}).scalars().all()
    return signing.matching_secret(secrets,
                                   headers.get(signing.TIMESTAMP_HEADER), headers.get(signing.SIGNATURE_HEADER),
                                   purpose, body)


def accept_batch(engine: Engine, our_instance: str, peer_instance: str, headers: Mapping[str, str],
                 batch: bytes) -> tuple[str, bytes]:
    """Checks the signature, stores the batch and commits, in one transaction; returns the secret it was signed
    under and the answer (JSON) to sign with it.  Raises signing.BadSignature or Malformed, with nothing stored.
    The batch is in a version this node takes (api.admission refused any other)."""
    version = wire.taken_version(headers.get("content-type"))
    purpose = signing.request_purpose("POST", signing.BATCHES_PATH, wire.media_type(version), our_instance)
    try:  # the traces' spans end after the commit (ExitStack), and only for a signed batch
        with engine.connect() as connection, ExitStack() as traces, \
                with_temporary_table(connection, "incoming_batch", "stage_batch").begin():
            secret = secret_of_signer(connection, peer_instance, purpose, headers, batch)
            _note_secret_use(connection, peer_instance, secret)
            stored = traces.enter_context(
                tracing.handed_on(batch, "accept", "server", {"pg_broker.peer": peer_instance}))
            with connection.connection.cursor() as cursor:
                cursor.copy_expert(COPY_BATCH[version].text, io.BytesIO(stored))
            answer = connection.execute(queries.QUERIES["accept_batch"], {"instance": peer_instance}).scalar_one()
    except (psycopg2.DataError, psycopg2.IntegrityError) as error:  # PostgreSQL's input checks refused it (COPY)
        raise Malformed(str(error).strip().splitlines()[0]) from error
    except (DataError, IntegrityError) as error:  # or the checks of broker.accept_transport_batch
        raise Malformed(str(error.orig).strip().splitlines()[0]) from error
    return secret, answer.encode()


def _note_secret_use(connection: Connection, peer_instance: str, secret: str) -> None:
    """Writes down, with the batch, that the peer signs with the secret: at most every NOTE_SECRET_USE_EVERY_S.
    Should the batch's transaction not commit, the next batch after that time writes it."""
    noted = (peer_instance, hashlib.sha256(secret.encode()).digest())
    if _secret_use_noted.get(noted, 0.0) > time.monotonic():
        return
    connection.execute(queries.QUERIES["note_secret_use"], {"instance": noted[0], "secret_sha256": noted[1]})
    _secret_use_noted[noted] = time.monotonic() + NOTE_SECRET_USE_EVERY_S
