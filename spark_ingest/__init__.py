"""The Spark job that ingests committed destination queues into Parquet."""
