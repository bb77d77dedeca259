//! The sidecar's one Redis connection, used by the fleet agent
//! ([`crate::fleet`]: its scripts and syncs) and the cache tier
//! ([`crate::cache`]: entries shared by the fleet): one client, one
//! connection, one count of what failed. Configured by the `fleet:`
//! section (URL, password, CA, timeout), which is what makes a sidecar
//! part of a fleet.
//!
//! Every call is bounded: `timeout` for connecting and for the answer
//! (redis-rs' own), and twice that around the whole call, so a Redis that
//! accepts the connection and never answers still fails the call. A failed
//! call is counted and said once per outage ([`link`]); the connection
//! manager reconnects on the next call.

pub mod link;

use std::future::Future;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::Mutex;

use crate::config::fleet::FleetConfig;

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// Redis did not answer (connect, TLS, authentication, timeout or a
    /// refused command): Redis' reason.
    #[error("redis: {0}")]
    Unavailable(String),
    /// A value that could not be written as Redis stores it.
    #[error("{0}")]
    Invalid(String),
}

/// The client for `config` (no connection yet): the URL checked, the
/// password from its file or variable, TLS with the CA given. Errors name
/// the field (`fleet.redis: …`).
pub fn client(config: &FleetConfig) -> Result<redis::Client, String> {
    use redis::IntoConnectionInfo;
    let bad = |field: &str, m: String| format!("fleet.{field}: {m}");
    let tls = config.redis.starts_with("rediss://");
    if !tls && !config.redis.starts_with("redis://") {
        return Err(bad(
            "redis",
            "`redis://host:port[/db]` or `rediss://` (TLS) expected".into(),
        ));
    }
    let info = config
        .redis
        .as_str()
        .into_connection_info()
        .map_err(|e| bad("redis", e.to_string()))?;
    if info.redis_settings().password().is_some() {
        return Err(bad(
            "redis",
            "no password in the URL (configs get copied and logged): \
             use fleet.password_file or fleet.password_env"
                .into(),
        ));
    }
    let info = match password(config)? {
        Some(p) if p.is_empty() => return Err(bad("password_file", "empty password".into())),
        Some(p) => {
            let settings = info.redis_settings().clone().set_password(p);
            info.set_redis_settings(settings)
        }
        None => info,
    };
    // rustls needs a process-wide crypto provider; installing it twice
    // is harmless (the first stays).
    let _ = rustls::crypto::ring::default_provider().install_default();
    match &config.tls_ca_file {
        Some(_) if !tls => Err(bad("tls_ca_file", "needs a `rediss://` URL (TLS)".into())),
        Some(ca) => {
            let pem = std::fs::read(ca)
                .map_err(|e| bad("tls_ca_file", format!("reading {}: {e}", ca.display())))?;
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
            .map_err(|e| bad("tls_ca_file", e.to_string()))
        }
        None => redis::Client::open(info).map_err(|e| bad("redis", e.to_string())),
    }
}

/// Redis' password (AUTH), from `password_file` or `password_env`.
fn password(config: &FleetConfig) -> Result<Option<String>, String> {
    let bad = |field: &str, m: String| format!("fleet.{field}: {m}");
    match (&config.password_file, &config.password_env) {
        (Some(_), Some(_)) => Err(bad(
            "password_file",
            "give password_file or password_env, not both".into(),
        )),
        (Some(p), None) => Ok(Some(
            std::fs::read_to_string(p)
                .map_err(|e| bad("password_file", format!("reading {}: {e}", p.display())))?
                .trim_end_matches(['\r', '\n'])
                .to_string(),
        )),
        (None, Some(name)) => std::env::var(name).map(Some).map_err(|_| {
            bad(
                "password_env",
                format!("the environment variable {name} is not set"),
            )
        }),
        (None, None) => Ok(None),
    }
}

/// One Redis connection, reconnected on demand.
pub struct Redis {
    client: redis::Client,
    /// The configured URL (it holds no password), for the log lines.
    target: String,
    timeout: Duration,
    /// How often the users compare their state with Redis
    /// (`fleet.sync_interval`).
    sync_interval: Duration,
    conn: Mutex<Option<ConnectionManager>>,
    /// Up, failed calls, and the lines they log.
    pub link: link::Link,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis")
            .field("target", &self.target)
            .finish()
    }
}

impl Redis {
    /// The connection of `config` through `client` (see [`client`]).
    pub fn new(client: redis::Client, config: &FleetConfig) -> Redis {
        Redis {
            client,
            target: config.redis.clone(),
            timeout: config.timeout,
            sync_interval: config.sync_interval,
            conn: Mutex::new(None),
            link: link::Link::default(),
        }
    }

    /// How often fleet state is compared with Redis.
    pub fn sync_interval(&self) -> Duration {
        self.sync_interval
    }

    /// The connection, made now if there is none (bounded by `timeout`).
    async fn connection(&self) -> Result<ConnectionManager, String> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(1);
        let made = tokio::time::timeout(
            self.timeout * 2,
            self.client.get_connection_manager_with_config(cfg),
        )
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
        *slot = Some(made.clone());
        Ok(made)
    }

    /// A failed call: counted, and logged when it starts a run of
    /// failures ([`link`]).
    fn failed(&self, e: impl std::fmt::Display) -> RedisError {
        let reason = e.to_string();
        if let Some(line) = self.link.failed(&self.target, &reason) {
            eprintln!("{line}");
        }
        RedisError::Unavailable(reason)
    }

    fn ok(&self) {
        if let Some(line) = self.link.ok(&self.target) {
            eprintln!("{line}");
        }
    }

    /// `send` on the connection, bounded, counted and said ([`link`]).
    async fn call<T, Fut>(
        &self,
        send: impl FnOnce(ConnectionManager) -> Fut,
    ) -> Result<T, RedisError>
    where
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let conn = self.connection().await.map_err(|e| self.failed(e))?;
        let answer = tokio::time::timeout(self.timeout * 2, send(conn))
            .await
            .map_err(|_| self.failed("timed out"))?
            .map_err(|e| self.failed(e))?;
        self.ok();
        Ok(answer)
    }

    /// A script.
    pub async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T, RedisError> {
        self.call(|mut c| async move { invocation.invoke_async::<T>(&mut c).await })
            .await
    }

    /// A command pipeline.
    pub async fn query<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<T, RedisError> {
        self.call(|mut c| async move { pipe.query_async::<T>(&mut c).await })
            .await
    }

    /// One command.
    pub async fn command<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, RedisError> {
        self.call(|mut c| async move { cmd.query_async::<T>(&mut c).await })
            .await
    }

    /// A clean-up command whose failure is neither counted nor said: the
    /// next round repeats it.
    pub async fn tidy(&self, cmd: &redis::Cmd) {
        if let Ok(mut conn) = self.connection().await {
            let _ = tokio::time::timeout(self.timeout * 2, cmd.query_async::<i64>(&mut conn)).await;
        }
    }
}

/// A real `redis-server` for tests (Debian's; `None`, saying so, where
/// there is none), stopped when dropped.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::Arc;
    use std::time::Duration;

    use super::Redis;
    use crate::config::fleet::FleetConfig;

    /// A connection to `url` with the default timeouts.
    pub(crate) fn connection(url: &str) -> Arc<Redis> {
        let config = FleetConfig {
            redis: url.into(),
            ..FleetConfig::default()
        };
        Arc::new(Redis::new(redis::Client::open(url).unwrap(), &config))
    }

    pub(crate) struct Server {
        pub(crate) child: std::process::Child,
        pub(crate) url: String,
        pub(crate) _dir: tempfile::TempDir,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    pub(crate) fn server() -> Option<Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let dir = tempfile::tempdir().ok()?;
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .spawn();
        let Ok(child) = child else {
            eprintln!("redis-server not found: skipping the real-Redis script tests");
            return None;
        };
        let server = Server {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            _dir: dir,
        };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("redis-server did not listen on {port}");
    }
}
