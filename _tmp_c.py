import random, time, tempfile
from pathlib import Path
from scripts.bench_transfer import bench_ttft, decode_node
if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        t=time.time()
        with decode_node(Path(tmp)) as single:
            print("single up", time.time()-t, flush=True)
            print(bench_ttft("nixl", single, Path(tmp), random.Random(1), 3), time.time()-t, flush=True)
