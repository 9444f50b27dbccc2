"""Prometheus metrics: counters kept by the relay and the REST API in this process, and gauges read
from the database at each scrape."""
from prometheus_client import Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from broker import queries

disable_created_metrics()  # no *_created series beside each counter

RELAY_SENT = Counter("broker_relay_messages_sent", "Messages the relay sent to a destination node, retries included",
                     ["destination"])
RELAY_ACKNOWLEDGED = Counter("broker_relay_messages_acknowledged",
                             "Messages a destination node acknowledged after its commit", ["destination"])
RELAY_FAILURES = Counter("broker_relay_failures", "Batches a destination did not take", ["destination"])
RELAY_BATCH_SECONDS = Histogram("broker_relay_batch_seconds",
                                "From sending a batch to applying its acknowledgements", ["destination"])
API_RECEIVED = Counter("broker_api_messages_received", "Messages handed out under a lock by the REST API", ["queue"])
API_COMPLETED = Counter("broker_api_messages_completed", "Messages consumed by completing a lock", ["queue"])
API_ABANDONED = Counter("broker_api_locks_abandoned", "Locks abandoned by REST readers", ["queue"])

class DatabaseCollector(Collector):
    """Queue depths and ages, activation, the transmission queue per destination, and the Spark ingests' lag, read
    at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        depth = GaugeMetricFamily("broker_queue_depth", "Messages waiting in a queue", labels=["queue"])
        oldest = GaugeMetricFamily("broker_queue_oldest_message_age_seconds", "Age of a queue's oldest waiting message",
                                   labels=["queue"])
        dead = GaugeMetricFamily("broker_queue_dead_letters", "Messages of a queue moved to broker.dead_letters",
                                 labels=["queue"])
        readers = GaugeMetricFamily("broker_queue_readers", "Transactions reading a queue now", labels=["queue"])
        waiting = GaugeMetricFamily("broker_transmission_queue_messages",
                                    "Messages waiting for a destination node's acknowledgement", labels=["destination"])
        waiting_age = GaugeMetricFamily("broker_transmission_queue_oldest_age_seconds",
                                        "Age of the oldest unacknowledged message per destination",
                                        labels=["destination"])
        activation_readers = GaugeMetricFamily("broker_activation_readers",
                                               "Readers calling a queue's activated procedure now, all nodes",
                                               labels=["queue"])
        activations = CounterMetricFamily("broker_activations", "Calls of a queue's activated procedure that "
                                          "committed, all nodes (recorded about once a second)", labels=["queue"])
        activation_failures = CounterMetricFamily("broker_activation_failures",
                                                  "Calls of a queue's activated procedure that rolled back, all nodes",
                                                  labels=["queue"])
        ingest_lag = GaugeMetricFamily("broker_ingest_lag_messages",
                                       "Messages above a Spark ingest's checkpoint, waiting for a run",
                                       labels=["queue", "output"])
        ingest_lag_age = GaugeMetricFamily("broker_ingest_lag_seconds",
                                           "Age of the oldest message waiting for a Spark ingest's run (0 when none)",
                                           labels=["queue", "output"])
        with self.engine.connect() as connection:
            for row in queries.queue_statuses(connection):
                depth.add_metric([row.queue_name], row.depth)
                oldest.add_metric([row.queue_name], row.oldest_message_age_s or 0.0)
                dead.add_metric([row.queue_name], row.dead_letters)
                readers.add_metric([row.queue_name], row.readers)
            for row in connection.execute(queries.QUERIES["activation_status"]):
                activation_readers.add_metric([row.queue_name], row.readers)
                activations.add_metric([row.queue_name], row.activations)
                activation_failures.add_metric([row.queue_name], row.failures)
            for row in connection.execute(queries.QUERIES["transmission_by_destination"]):
                waiting.add_metric([row.destination], row.messages)
                waiting_age.add_metric([row.destination], row.oldest_message_age_s)
            for row in connection.execute(queries.QUERIES["ingests"]):
                ingest_lag.add_metric([row.queue_name, row.output], row.lag_messages)
                ingest_lag_age.add_metric([row.queue_name, row.output], row.lag_s)
        yield from (depth, oldest, dead, readers, activation_readers, activations, activation_failures, waiting,
                    waiting_age, ingest_lag, ingest_lag_age)
