-- Run once by the postgres image on an empty data volume (as POSTGRES_USER, in POSTGRES_DB=prefect).
-- Prefect and MLflow each keep their own Alembic version table, so each gets its own database.
CREATE DATABASE mlflow;
