# The dashboard's image (compose.yaml's `dashboard` service): streamlit on the traces in
# Jaeger (PUSHKV_JAEGER_URL) or in a mounted run folder. pushkv's telemetry and dashboard
# only: no vLLM, no NIXL, no connector.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY telemetry ./telemetry
COPY dashboard ./dashboard
RUN pip install '.[dashboard]' && useradd --uid 10001 --create-home dashboard
USER 10001

EXPOSE 8501
# inside the container the server must listen on all interfaces for the published port;
# compose publishes it on the host's 127.0.0.1 only
CMD ["streamlit", "run", "dashboard/app.py", "--server.address", "0.0.0.0", \
     "--server.port", "8501", "--server.headless", "true", \
     "--browser.gatherUsageStats", "false", "--server.enableStaticServing", "true", \
     "--client.toolbarMode", "minimal"]
