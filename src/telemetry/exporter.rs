//! The Prometheus endpoint of a run (`--metrics-port`): `GET /metrics` answers the reporting
//! rank's latest step figures in the OpenMetrics text format (prometheus-client encodes them),
//! every sample labelled with the job, the rank and its role. A figure the job does not have
//! (a pipeline's bubble in a data-parallel job, GPU memory on CPUs) has no sample rather than
//! a NaN. It serves only while training runs: the task ends when the exporter is dropped.

use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::metrics::StepMetrics;

type FloatGauge = Gauge<f64, AtomicU64>;

/// A figure some jobs have: a family that holds a sample only once a value came.
type OptionalGauge = Family<Vec<(String, String)>, FloatGauge>;

/// The gauges a scrape reads.
#[derive(Default, Clone)]
struct Gauges {
    steps: Counter,
    loss: FloatGauge,
    loss_spread: OptionalGauge,
    samples_per_sec: FloatGauge,
    step_time: FloatGauge,
    comm_time_ratio: FloatGauge,
    exposed_comm_ratio: FloatGauge,
    bubble_fraction: OptionalGauge,
    learning_rate: FloatGauge,
    peak_rss: Gauge,
    gpu_memory: OptionalGauge,
    gpu_utilization: OptionalGauge,
    eval_loss: OptionalGauge,
    eval_accuracy: OptionalGauge,
    eval_mse: OptionalGauge,
    sparse_rows: TableGauges,
    sparse_admitted: TableGauges,
    sparse_evicted: TableGauges,
    sparse_deleted: TableGauges,
}

/// One gauge per sparse table, labelled `table`.
type TableGauges = Family<Vec<(String, String)>, Gauge>;

impl Gauges {
    /// Every gauge, in the order a scrape lists them, each sample labelled with `labels`.
    fn registry(&self, labels: &MetricLabels) -> Registry {
        let labels = [
            ("job", labels.job.clone()),
            ("rank", labels.rank.to_string()),
            ("role", labels.role.to_string()),
        ];
        let mut registry =
            Registry::with_prefix_and_labels("flotilla", labels.into_iter().map(|(k, v)| (k.into(), v.into())));
        self.register_step_figures(&mut registry);
        self.register_resources(&mut registry);
        self.register_evaluation(&mut registry);
        self.register_sparse_tables(&mut registry);
        registry
    }

    /// The figures of the last step, and the training counters.
    fn register_step_figures(&self, registry: &mut Registry) {
        registry.register("steps", "Training steps done", self.steps.clone());
        registry.register(
            "loss",
            "Mean loss over the global batch of the last step",
            self.loss.clone(),
        );
        registry.register(
            "loss_spread",
            "Largest minus smallest rank loss of the last step",
            self.loss_spread.clone(),
        );
        registry.register(
            "samples_per_second",
            "Global samples per second of the last step",
            self.samples_per_sec.clone(),
        );
        registry.register(
            "step_time_seconds",
            "Wall time of the last step",
            self.step_time.clone(),
        );
        registry.register(
            "comm_time_ratio",
            "Time in communication over step time, last step",
            self.comm_time_ratio.clone(),
        );
        registry.register(
            "exposed_comm_ratio",
            "Time compute waited for communication over step time, last step",
            self.exposed_comm_ratio.clone(),
        );
        registry.register(
            "bubble_fraction",
            "Pipeline jobs: time stages waited for neighbours over schedule time, last step",
            self.bubble_fraction.clone(),
        );
        registry.register(
            "learning_rate",
            "Learning rate of the last step",
            self.learning_rate.clone(),
        );
    }

    /// What the job's processes hold of the machine.
    fn register_resources(&self, registry: &mut Registry) {
        registry.register(
            "peak_rss_bytes",
            "Largest peak resident set of the job's processes",
            self.peak_rss.clone(),
        );
        registry.register(
            "gpu_memory_bytes",
            "GPU jobs: device memory in use on the reporting process's GPUs",
            self.gpu_memory.clone(),
        );
        registry.register(
            "gpu_utilization_percent",
            "GPU jobs: share of time a kernel ran on the reporting process's GPUs",
            self.gpu_utilization.clone(),
        );
    }

    /// The last held-out score.
    fn register_evaluation(&self, registry: &mut Registry) {
        registry.register(
            "eval_loss",
            "Mean loss on the held-out split, where it was last scored (train.eval_every)",
            self.eval_loss.clone(),
        );
        registry.register(
            "eval_accuracy",
            "Classification: accuracy on the held-out split, where it was last scored",
            self.eval_accuracy.clone(),
        );
        registry.register(
            "eval_mse",
            "Regression: mean squared error on the held-out split, where it was last scored",
            self.eval_mse.clone(),
        );
    }

    /// Parameter-server jobs: the rows of each sparse table.
    fn register_sparse_tables(&self, registry: &mut Registry) {
        registry.register(
            "sparse_table_rows",
            "Parameter-server jobs with row policies: rows a table holds over all shards",
            self.sparse_rows.clone(),
        );
        registry.register(
            "sparse_table_admitted_rows",
            "Rows a table's entry rule stored so far",
            self.sparse_admitted.clone(),
        );
        registry.register(
            "sparse_table_evicted_rows",
            "Rows a table evicted for its memory cap so far",
            self.sparse_evicted.clone(),
        );
        registry.register(
            "sparse_table_deleted_rows",
            "Rows a table deleted at pass ends so far",
            self.sparse_deleted.clone(),
        );
    }
}

/// Where `--metrics-port` listens: `PORT` alone is loopback only, since the endpoint has no
/// authentication and shows the run's figures to whoever connects; `ADDRESS:PORT` (e.g.
/// `0.0.0.0:9400`) opens it to a scraper on another machine.
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    text.parse()
        .map_err(|_| format!("{text:?} is neither a port nor an address:port (e.g. 9400 or 0.0.0.0:9400)"))
}

/// Who the figures are of: the labels of every sample.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricLabels {
    /// The job (`cluster.job_id`, else the run directory's name).
    pub job: String,
    /// The reporting rank.
    pub rank: usize,
    /// Its role: `trainer`, `stage` or `ps_trainer`.
    pub role: &'static str,
}

/// Serves `/metrics` on a port while it lives.
pub struct Exporter {
    gauges: Gauges,
    server: tokio::task::JoinHandle<()>,
}

impl Exporter {
    /// Listens at `address` ([`parse_listen_address`]). Must be called inside a tokio runtime.
    pub fn serve(address: SocketAddr, labels: &MetricLabels) -> Result<Self> {
        let listener = StdListener::bind(address)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .with_context(|| format!("--metrics-port {address}: cannot listen"))?;
        let gauges = Gauges::default();
        let registry = Arc::new(gauges.registry(labels));
        let server = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let registry = registry.clone();
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, &registry).await {
                        tracing::debug!("metrics scrape: {e:#}");
                    }
                });
            }
        });
        tracing::info!("serving Prometheus metrics on http://{address}/metrics");
        Ok(Self { gauges, server })
    }

    /// Publishes a step's figures.
    pub fn publish(&self, m: &StepMetrics) {
        let g = &self.gauges;
        g.steps.inc_by((m.step as u64).saturating_sub(g.steps.get()));
        g.loss.set(f64::from(m.loss));
        set_optional(&g.loss_spread, m.loss_spread.map(f64::from));
        g.samples_per_sec.set(m.samples_per_sec);
        g.step_time.set(m.step_time_s);
        g.comm_time_ratio.set(m.comm_time_ratio);
        g.exposed_comm_ratio.set(m.exposed_comm_ratio);
        set_optional(&g.bubble_fraction, m.bubble_fraction);
        g.learning_rate.set(m.lr);
        g.peak_rss.set(i64::try_from(m.peak_rss_bytes).unwrap_or(i64::MAX));
        set_optional(&g.gpu_memory, m.gpu_memory_bytes.map(|b| b as f64));
        set_optional(&g.gpu_utilization, m.gpu_utilization);
        if let Some(eval) = &m.eval {
            set_optional(&g.eval_loss, Some(eval.loss));
            set_optional(&g.eval_accuracy, eval.accuracy);
            set_optional(&g.eval_mse, eval.mse);
        }
        for table in m.sparse_tables.iter().flatten() {
            let label = vec![("table".to_owned(), table.table.clone())];
            for (family, value) in [
                (&g.sparse_rows, table.rows),
                (&g.sparse_admitted, table.admitted),
                (&g.sparse_evicted, table.evicted),
                (&g.sparse_deleted, table.deleted),
            ] {
                family
                    .get_or_create(&label)
                    .set(i64::try_from(value).unwrap_or(i64::MAX));
            }
        }
    }
}

/// Sets `gauge`'s one sample to `value`, when there is one (and a number).
fn set_optional(gauge: &OptionalGauge, value: Option<f64>) {
    if let Some(value) = value.filter(|v| v.is_finite()) {
        gauge.get_or_create(&Vec::new()).set(value);
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Longest a scraper may take to send its request.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// Reads one HTTP request head and answers it: the metrics for `GET /metrics`, 404 otherwise.
async fn answer(mut stream: TcpStream, registry: &Registry) -> Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buffer = [0u8; 1024];
    tokio::time::timeout(REQUEST_DEADLINE, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
            let n = stream.read(&mut buffer).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buffer[..n]);
        }
        anyhow::Ok(())
    })
    .await
    .context("the request did not arrive in time")??;
    let request_line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let response = if request_line.starts_with(b"GET /metrics ") {
        let mut body = String::new();
        encode(&mut body, registry).context("encoding the metrics")?;
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.1 404 Not Found\r\nContent-Length: 24\r\nConnection: close\r\n\r\nonly /metrics is served\n".to_string()
    };
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::HeldOut;
    use crate::telemetry::metrics::SparseTableMetrics;

    async fn get(port: u16, path: &str) -> Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
            .await?;
        let mut response = String::new();
        tokio::time::timeout(REQUEST_DEADLINE, stream.read_to_string(&mut response)).await??;
        Ok(response)
    }

    #[tokio::test]
    async fn a_scrape_reads_the_latest_step() -> Result<()> {
        let port = StdListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let labels = MetricLabels {
            job: "job-7".into(),
            rank: 0,
            role: "trainer",
        };
        let address = parse_listen_address(&port.to_string()).map_err(anyhow::Error::msg)?;
        let exporter = Exporter::serve(address, &labels)?;
        exporter.publish(&StepMetrics {
            step: 7,
            elapsed_s: 1.0,
            step_time_s: 0.125,
            samples_per_sec: 512.0,
            comm_time_ratio: 0.25,
            exposed_comm_ratio: 0.0625,
            bubble_fraction: None,
            peak_rss_bytes: 1 << 20,
            gpu_memory_bytes: None,
            gpu_utilization: None,
            lr: 0.05,
            loss: 1.5,
            loss_spread: Some(0.5),
            sparse_tables: Some(vec![SparseTableMetrics {
                table: "embedding".into(),
                rows: 40,
                admitted: 50,
                evicted: 6,
                deleted: 4,
            }]),
            eval: Some(HeldOut {
                loss: 0.75,
                accuracy: Some(0.875),
                perplexity: Some(0.75f64.exp()),
                mse: None,
                samples: 64,
            }),
        });
        let response = get(port, "/metrics").await?;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        let ours = "job=\"job-7\",rank=\"0\",role=\"trainer\"";
        for line in [
            format!("flotilla_steps_total{{{ours}}} 7"),
            format!("flotilla_loss{{{ours}}} 1.5"),
            format!("flotilla_loss_spread{{{ours}}} 0.5"),
            format!("flotilla_eval_loss{{{ours}}} 0.75"),
            format!("flotilla_eval_accuracy{{{ours}}} 0.875"),
            format!("flotilla_comm_time_ratio{{{ours}}} 0.25"),
            format!("flotilla_peak_rss_bytes{{{ours}}} 1048576"),
            format!("flotilla_sparse_table_rows{{{ours},table=\"embedding\"}} 40"),
            format!("flotilla_sparse_table_evicted_rows{{{ours},table=\"embedding\"}} 6"),
            "# EOF".to_string(),
        ] {
            assert!(response.lines().any(|l| l == line), "no {line:?} in {response}");
        }
        // Figures this job does not have: no sample, and never a NaN.
        assert!(!response.contains("NaN"), "{response}");
        for absent in [
            "flotilla_bubble_fraction{",
            "flotilla_gpu_memory_bytes{",
            "flotilla_eval_mse{",
        ] {
            assert!(!response.contains(absent), "{absent} in {response}");
        }
        assert!(get(port, "/").await?.starts_with("HTTP/1.1 404"));
        drop(exporter);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect(("127.0.0.1", port)).await.is_err(),
            "still serving after drop"
        );
        Ok(())
    }

    #[test]
    fn a_port_in_use_is_named() -> Result<()> {
        let taken = StdListener::bind("127.0.0.1:0")?;
        let address = taken.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let labels = MetricLabels {
            job: "j".into(),
            rank: 0,
            role: "trainer",
        };
        let error = runtime.block_on(async { Exporter::serve(address, &labels).err() });
        let error = format!("{:#}", error.context("a second listener on a used port")?);
        assert!(error.contains(&format!("--metrics-port {address}")), "{error}");
        Ok(())
    }

    #[test]
    fn a_bare_port_listens_on_loopback_only() {
        assert_eq!(parse_listen_address("9400"), Ok("127.0.0.1:9400".parse().unwrap()));
        assert_eq!(
            parse_listen_address("0.0.0.0:9400"),
            Ok("0.0.0.0:9400".parse().unwrap())
        );
        assert_eq!(parse_listen_address("[::1]:9400"), Ok("[::1]:9400".parse().unwrap()));
        let error = parse_listen_address("9400x").unwrap_err();
        assert!(
            error.contains("\"9400x\" is neither a port nor an address:port"),
            "{error}"
        );
    }
}
