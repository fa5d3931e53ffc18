"""How one model trains on this rank, for every stage that trains: the torch and DeepSpeed engines, their settings
and DeepSpeed config, loading into ZeRO-3 partitions, collectives over the ranks, micro-batches and schedules."""
