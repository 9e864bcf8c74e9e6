-- The demo's "existing application": a users table the guard did not create, filled with
-- 10,000 rows. docker-compose.yml's guard-pg fronts it (GUARD_RECORDS_TABLE=users); the
-- postgres image runs this file once, when its data volume is new.
CREATE TABLE users (
    id bigint PRIMARY KEY,
    email text NOT NULL UNIQUE,
    name text
);

INSERT INTO users (id, email, name)
SELECT g, 'user' || g || '@example.com', 'User ' || g
FROM generate_series(1, 10000) AS g;
