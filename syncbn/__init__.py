"""SyncBatchNorm written once against the collectives interface."""
