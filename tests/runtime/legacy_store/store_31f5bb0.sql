--
-- PostgreSQL database dump
--


-- Dumped from database version 15.18 (Debian 15.18-0+deb12u1)
-- Dumped by pg_dump version 15.18 (Debian 15.18-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: api_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.api_keys (
    digest character varying(64) NOT NULL,
    key_id character varying(32) NOT NULL,
    tenant character varying(128) NOT NULL,
    created_at timestamp with time zone NOT NULL,
    revoked_at timestamp with time zone,
    admin boolean
);


--
-- Name: checkpoints; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.checkpoints (
    id integer NOT NULL,
    run_id character varying(200) NOT NULL,
    kind character varying(32) NOT NULL,
    name character varying(128) NOT NULL,
    tenant character varying(128) NOT NULL,
    size_bytes integer NOT NULL,
    created_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone,
    user_metadata json NOT NULL,
    public boolean
);


--
-- Name: checkpoints_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.checkpoints_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: checkpoints_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.checkpoints_id_seq OWNED BY public.checkpoints.id;


--
-- Name: futures; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.futures (
    id character varying(64) NOT NULL,
    tenant character varying(128) NOT NULL,
    request_type character varying(64) NOT NULL,
    run_id character varying(200),
    seq_id bigint,
    status character varying(16) NOT NULL,
    result text,
    error text,
    category character varying(16),
    created_at timestamp with time zone NOT NULL,
    completed_at timestamp with time zone
);


--
-- Name: run_metrics; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.run_metrics (
    id bigint NOT NULL,
    run_id character varying(200) NOT NULL,
    seq_id bigint NOT NULL,
    step integer NOT NULL,
    kind character varying(16) NOT NULL,
    metrics text NOT NULL,
    recorded_at timestamp with time zone NOT NULL
);


--
-- Name: run_metrics_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.run_metrics_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: run_metrics_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.run_metrics_id_seq OWNED BY public.run_metrics.id;


--
-- Name: samplers; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.samplers (
    id character varying(200) NOT NULL,
    session_id character varying(64) NOT NULL,
    tenant character varying(128) NOT NULL,
    base_model character varying(300) NOT NULL,
    model_path character varying(500),
    snapshot_dir character varying(1000),
    created_at timestamp with time zone NOT NULL,
    last_used_at timestamp with time zone
);


--
-- Name: sessions; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.sessions (
    id character varying(64) NOT NULL,
    tenant character varying(128) NOT NULL,
    created_at timestamp with time zone NOT NULL,
    last_heartbeat_at timestamp with time zone NOT NULL,
    finished_reason character varying(32),
    user_metadata json NOT NULL,
    display_name text
);


--
-- Name: training_runs; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.training_runs (
    id character varying(200) NOT NULL,
    session_id character varying(64) NOT NULL,
    tenant character varying(128) NOT NULL,
    base_model character varying(300) NOT NULL,
    lora_config json NOT NULL,
    user_metadata json NOT NULL,
    status character varying(16) NOT NULL,
    created_at timestamp with time zone NOT NULL,
    last_request_at timestamp with time zone NOT NULL,
    last_seq_id bigint,
    last_step integer
);


--
-- Name: checkpoints id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.checkpoints ALTER COLUMN id SET DEFAULT nextval('public.checkpoints_id_seq'::regclass);


--
-- Name: run_metrics id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.run_metrics ALTER COLUMN id SET DEFAULT nextval('public.run_metrics_id_seq'::regclass);


--
-- Data for Name: api_keys; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.api_keys VALUES ('abababababababababababababababababababababababababababababababab', 'key-legacy', 'alice', '2026-11-02 08:00:30.25+00', NULL, true);


--
-- Data for Name: checkpoints; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.checkpoints VALUES (1, 's-legacy:train:0', 'sampler_weights', 'final', 'alice', 2147483647, '2026-11-02 09:20:30.25+00', '2026-11-02 21:20:30.25+00', '{"note": "kept"}', true);


--
-- Data for Name: futures; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.futures VALUES ('req-pass', 'alice', 'ForwardBackward', 's-legacy:train:0', 1, 'complete', '{"pass_result": {"outputs": [{"logprobs": {"dtype": "<f4", "shape": [3], "data": "AAAAvwAAoL8AAADA"}, "elementwise_loss": {"dtype": "<f4", "shape": [3], "data": "AAAAPwAAoD8AAABA"}}, {"logprobs": {"dtype": "<f4", "shape": [1], "data": "AABAwA=="}, "elementwise_loss": {"dtype": "<f4", "shape": [1], "data": "AABAQA=="}}], "metrics": {"loss:sum": 9.0}}}', NULL, NULL, '2026-11-02 09:10:30.25+00', '2026-11-02 09:11:30.25+00');
INSERT INTO public.futures VALUES ('req-failed', 'alice', 'OptimStep', 's-legacy:train:0', 2, 'failed', NULL, 'learning_rate must be > 0, not -1.0', 'user', '2026-11-02 09:12:30.25+00', '2026-11-02 09:12:30.25+00');
INSERT INTO public.futures VALUES ('req-sample', 'alice', 'Sample', 's-legacy:sample:0', 3000000001, 'complete', '{"sample_result": {"sequences": [{"tokens": {"dtype": "<i4", "shape": [2], "data": "BAAAAAUAAAA="}, "logprobs": {"dtype": "<f4", "shape": [2], "data": "AAAAvwAAgL4="}, "stop": "length", "topk_ids": {"dtype": "<i4", "shape": [2, 2], "data": "BAAAAAIAAAAFAAAA/////w=="}, "topk_logprobs": {"dtype": "<f4", "shape": [2, 2], "data": "AAAAvwAAwL8AAIC+AADAfw=="}}, {"tokens": {"dtype": "<i4", "shape": [1], "data": "CQAAAA=="}, "logprobs": {"dtype": "<f4", "shape": [1], "data": "AACAvw=="}, "stop": "stop", "topk_ids": null, "topk_logprobs": null}], "prompt_logprobs": {"dtype": "<f4", "shape": [3], "data": "AADAfwAAgL8AAADA"}, "topk_prompt_ids": {"dtype": "<i4", "shape": [3, 2], "data": "//////////8DAAAAAQAAAAIAAAAAAAAA"}, "topk_prompt_logprobs": {"dtype": "<f4", "shape": [3, 2], "data": "AADAfwAAwH8AAIC/AAAAwAAAAMAAAGDA"}, "target_prompt_logprobs": null, "prompt_alt_ids": null, "prompt_alt_logprobs": null, "target_prompt_is_sparse": false}}', NULL, NULL, '2026-11-02 09:25:30.25+00', '2026-11-02 09:26:30.25+00');
INSERT INTO public.futures VALUES ('req-pending', 'alice', 'CreateSession', NULL, NULL, 'pending', NULL, NULL, NULL, '2026-11-02 09:29:30.25+00', NULL);
INSERT INTO public.futures VALUES ('req-save', 'alice', 'SaveWeightsForSampler', 's-legacy:train:0', 7, 'complete', '{"path": "tinker://s-legacy:train:0/sampler_weights/final", "type": "save_weights_for_sampler"}', NULL, NULL, '2026-11-02 09:30:30.25+00', '2026-11-02 09:31:30.25+00');


--
-- Data for Name: run_metrics; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.run_metrics VALUES (1, 's-legacy:train:0', 1, 1, 'forward_backward', '{"loss:sum": 9.0}', '2026-11-02 09:11:30.25+00');
INSERT INTO public.run_metrics VALUES (2, 's-legacy:train:0', 3, 1, 'optim_step', '{"grad_norm": 0.75, "learning_rate": 0.0001}', '2026-11-02 09:13:30.25+00');
INSERT INTO public.run_metrics VALUES (3, 's-legacy:train:0', 5, 2, 'optim_step', '{"grad_norm": 0.5, "learning_rate": 0.0001}', '2026-11-02 09:15:30.25+00');


--
-- Data for Name: samplers; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.samplers VALUES ('s-legacy:sample:0', 's-legacy', 'alice', 'tiny', 'tinker://s-legacy:train:0/sampler_weights/final', NULL, '2026-11-02 09:21:30.25+00', '2026-11-02 09:25:30.25+00');


--
-- Data for Name: sessions; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.sessions VALUES ('s-legacy', 'alice', '2026-11-02 09:00:30.25+00', '2026-11-02 09:40:30.25+00', NULL, '{"project": "legacy"}', 'the legacy session');


--
-- Data for Name: training_runs; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.training_runs VALUES ('s-legacy:train:0', 's-legacy', 'alice', 'tiny', '{"rank": 8, "train_mlp": true}', '{"purpose": "fixture"}', 'parked', '2026-11-02 09:01:30.25+00', '2026-11-02 09:30:30.25+00', 7, 2);


--
-- Name: checkpoints_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.checkpoints_id_seq', 1, true);


--
-- Name: run_metrics_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.run_metrics_id_seq', 3, true);


--
-- Name: api_keys api_keys_key_id_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.api_keys
    ADD CONSTRAINT api_keys_key_id_key UNIQUE (key_id);


--
-- Name: api_keys api_keys_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.api_keys
    ADD CONSTRAINT api_keys_pkey PRIMARY KEY (digest);


--
-- Name: checkpoints checkpoints_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.checkpoints
    ADD CONSTRAINT checkpoints_pkey PRIMARY KEY (id);


--
-- Name: futures futures_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.futures
    ADD CONSTRAINT futures_pkey PRIMARY KEY (id);


--
-- Name: run_metrics run_metrics_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.run_metrics
    ADD CONSTRAINT run_metrics_pkey PRIMARY KEY (id);


--
-- Name: samplers samplers_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.samplers
    ADD CONSTRAINT samplers_pkey PRIMARY KEY (id);


--
-- Name: sessions sessions_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.sessions
    ADD CONSTRAINT sessions_pkey PRIMARY KEY (id);


--
-- Name: training_runs training_runs_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.training_runs
    ADD CONSTRAINT training_runs_pkey PRIMARY KEY (id);


--
-- Name: checkpoints uq_checkpoint_path; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.checkpoints
    ADD CONSTRAINT uq_checkpoint_path UNIQUE (run_id, kind, name);


--
-- Name: futures uq_future_run_seq; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.futures
    ADD CONSTRAINT uq_future_run_seq UNIQUE (run_id, seq_id);


--
-- Name: ix_checkpoints_tenant_created; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_checkpoints_tenant_created ON public.checkpoints USING btree (tenant, created_at);


--
-- Name: ix_futures_completed; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_futures_completed ON public.futures USING btree (completed_at);


--
-- Name: ix_futures_tenant_created; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_futures_tenant_created ON public.futures USING btree (tenant, created_at);


--
-- Name: ix_run_metrics_run; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_run_metrics_run ON public.run_metrics USING btree (run_id, id);


--
-- Name: ix_runs_tenant_created; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_runs_tenant_created ON public.training_runs USING btree (tenant, created_at);


--
-- PostgreSQL database dump complete
--


