"""A runner written from docs/wire.md alone: standard library only, no agentserver import.

    python raw_runner.py HOST PORT CLIENT LISTENER

The token is read from $RAW_RUNNER_TOKEN. It serves LISTENER one job at a time and
answers each job's payload with the same payload, upper-cased text, tagged ``<result>``
in the payload's namespace plus a ``<runner>raw</runner>`` element.
"""

import os
import socket
import struct
import sys
import uuid
import xml.etree.ElementTree as ET

ENV = "https://xml-pipeline.org/ns/envelope/v1"
CORE = "https://xml-pipeline.org/ns/core/v1"


def frame(xml: str) -> bytes:
    body = xml.encode("utf-8")
    return struct.pack(">I", len(body)) + body


def envelope(sender: str, thread: str, payload: str) -> bytes:
    return frame(
        f'<message xmlns="{ENV}"><meta><from>{sender}</from><thread>{thread}</thread></meta>'
        f"{payload}</message>"
    )


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def main() -> None:
    host, port, client, listener = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    token = os.environ["RAW_RUNNER_TOKEN"]
    sock = socket.create_connection((host, port))
    hello = f'<hello xmlns="{CORE}"><client>{client}</client><token>{token}</token></hello>'
    sock.sendall(envelope(client, str(uuid.uuid4()), hello))
    serve = f'<serve xmlns="{CORE}" listener="{listener}" concurrency="1"/>'
    sock.sendall(envelope(client, str(uuid.uuid4()), serve))
    print("serving", flush=True)
    while True:
        try:
            (size,) = struct.unpack(">I", read_exact(sock, 4))
            root = ET.fromstring(read_exact(sock, size))
        except EOFError:
            return
        meta, payload = root[0], root[1]
        to = meta.find(f"{{{ENV}}}to")
        if to is None or to.text != listener:
            continue  # a refusal addressed to us
        thread = meta.find(f"{{{ENV}}}thread").text
        ns = payload.tag[1:].split("}")[0]
        text = payload.find(f"{{{ns}}}text").text or ""
        sock.sendall(envelope(client, thread, f'<started xmlns="{CORE}"/>'))
        result = ET.Element(f"{{{ns}}}result")
        ET.SubElement(result, f"{{{ns}}}text").text = text.upper()
        ET.SubElement(result, f"{{{ns}}}runner").text = "raw"
        ET.register_namespace("", ns)
        sock.sendall(envelope(client, thread, ET.tostring(result, encoding="unicode")))


if __name__ == "__main__":
    main()
