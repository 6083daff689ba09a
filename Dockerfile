# agentserver in a container: slim Python, a non-root user, state in a volume.
#
#   docker build -t agentserver .
#   docker run --rm -p 7340:7340 -v agentserver-state:/var/lib/agentserver agentserver
#
# The server listens on 0.0.0.0 inside the container. With no <clients> declared,
# connections are anonymous, which `run` allows off loopback only with --insecure: mount
# your own boot.xml with declared clients (and <tls>) for anything but a local trial.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/agentserver
COPY pyproject.toml setup.py README.md LICENSE boot.xml ./
COPY agentserver ./agentserver
COPY listeners ./listeners
COPY primitives ./primitives
COPY schemas ./schemas
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /var/lib/agentserver --create-home agentserver \
    && sed 's|<store path="state/agents.sqlite3"/>|<store path="/var/lib/agentserver/state/agents.sqlite3"/>|' \
        boot.xml > /etc/agentserver-boot.xml \
    && grep -q 'path="/var/lib/agentserver/state/' /etc/agentserver-boot.xml

# Relative paths in boot.xml resolve against boot.xml's own folder (here /etc), so the
# image's copy names its agent store absolutely, in the volume; a boot.xml you mount
# should too (<store path="/var/lib/agentserver/state/agents.sqlite3"/>).
VOLUME /var/lib/agentserver
WORKDIR /var/lib/agentserver
USER agentserver

ENV AGENTSERVER_HOST=0.0.0.0 \
    AGENTSERVER_PORT=7340 \
    AGENTSERVER_BOOT=/etc/agentserver-boot.xml \
    AGENTSERVER_LOG_LEVEL=info
EXPOSE 7340

ENTRYPOINT ["agentserver", "run"]
CMD ["--insecure"]
