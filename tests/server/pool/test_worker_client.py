"""WorkerClient's supervision policy on a real spawned worker: a first load that fails stays down.

(A worker that dies after it served is restarted: tests/server/pool/test_supervision.py kills one.)
"""

import asyncio

from xinserve.server.pool.worker_client import FAILED, WorkerClient
from xinserve.server.worker.engine_worker import WorkerSpec


def test_a_worker_whose_first_load_fails_is_not_restarted(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    spec = WorkerSpec(model_name="m", label="cpu", device="cpu", model_path=str(empty), engine_kwargs={},
                      input_addr=f"ipc://{tmp_path}/in", output_addr=f"ipc://{tmp_path}/out", cpu_threads=1)

    async def go():
        client = WorkerClient("m", "cpu", "cpu", max_num_seqs=1, max_waiting_requests=0)
        client.start(spec)
        try:
            while client._supervisor is None:  # set when the process has exited
                await asyncio.sleep(0.05)
            await client._supervisor  # with a restart due, this would sleep the backoff, then spawn
            return client.state, client.restarts, client.last_error
        finally:
            await client.close(0)

    state, restarts, error = asyncio.run(asyncio.wait_for(go(), 120))
    assert state == FAILED and restarts == 0
    assert error  # the load's exception, for /health
