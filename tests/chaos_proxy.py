"""A TCP proxy the fault tests control: it cuts requests, drops responses after the far side
has committed, and delays traffic, each by a seeded random plan."""
import random
import socket
import threading
import time
from collections import Counter


class ChaosProxy:
    def __init__(self, upstream_port: int, seed: int, *, cut_request=0.05, drop_response=0.1, delay=0.1,
                 max_delay_s=0.5):
        self.upstream_port = upstream_port
        self.rng = random.Random(seed)
        self.odds = {"cut_request": cut_request, "drop_response": drop_response, "delay": delay}
        self.max_delay_s = max_delay_s
        self.enabled = True
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _roll(self, fault: str) -> bool:
        with self.lock:
            hit = self.enabled and self.rng.random() < self.odds[fault]
            if hit:
                self.counts[fault] += 1
            return hit

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=self._pump, args=(client, upstream, "request"), daemon=True).start()
        self._pump(upstream, client, "response")

    def _pump(self, source: socket.socket, target: socket.socket, direction: str) -> None:
        try:
            while data := source.recv(65536):
                if self._roll("delay"):
                    time.sleep(self.rng.random() * self.max_delay_s)
                if direction == "request" and self._roll("cut_request"):
                    target.sendall(data[: len(data) // 2])
                    break
                if direction == "response" and self._roll("drop_response"):
                    break  # the far side committed; its answer never arrives
                target.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, target):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.listener.close()
