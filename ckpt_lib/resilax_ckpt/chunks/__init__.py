"""The chunk layer: how a step's array chunks lie on disk and how they are written and read, used by
both the save and the restore side and knowing nothing of either (an import-linter contract keeps it so).

- `backends`: the one interface (`ChunkBackend`) and `for_storage`, which picks the file backend for
  local folders or the tensorstore one (`resilax_ckpt.tensorstore_io`) for gs://.
- `chunk_format` (pure): zarr3 arrays, chunk keys, shard files and their index: where every chunk is;
  `checksums`: the crc32c after every chunk.
- `chunk_writer` and `file_reader`: the file backend's writes (in place, O_DIRECT, one flush per save)
  and reads (straight into the restored buffers).
- `reader`: the restore's read loop over either backend; `host_ring`: the memory it reads into;
  `staging`: the huge-page buffers every O_DIRECT request goes through; `inflight`: the bound on bytes
  of I/O in flight; `sources`: what a save's write reads from (a shard's `Landing` on the host).
"""
