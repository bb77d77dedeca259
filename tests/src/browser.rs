//! Headless Chromium for the operator page's tests, driven through
//! chromedriver's W3C WebDriver HTTP API with a few JSON calls (the whole
//! protocol used here: new session, navigate, run a script, find an
//! element, type, click, screenshot, delete session).
//!
//! Chromium and chromedriver are Debian's `chromium` and `chromium-driver`
//! (`make test` installs them). [`Browser::start`] answers `None` when they
//! are missing, after saying so, unless `SLUICE_REQUIRE_BROWSER` is set:
//! then a missing browser fails the test, so CI cannot skip it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

use crate::{read_log, temp_dir, ChildGuard, STARTUP_TIMEOUT};

/// The file `env` names if it is set (and nothing else then), else the
/// first of `names` found as a file or on `PATH`.
fn find(env: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    names.iter().find_map(|n| {
        let direct = Path::new(n);
        if direct.is_absolute() {
            return direct.is_file().then(|| direct.to_path_buf());
        }
        std::env::split_paths(&path)
            .map(|d| d.join(n))
            .find(|p| p.is_file())
    })
}

/// The element reference key of the W3C WebDriver protocol.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process with one headless Chromium session; both end on
/// drop.
pub struct Browser {
    base: String,
    session: String,
    client: reqwest::blocking::Client,
    // Declared last: dropped after the session is deleted.
    _dir: tempfile::TempDir,
    _driver: ChildGuard,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a fresh profile.
    /// `None` (after printing why) when either is missing and
    /// `SLUICE_REQUIRE_BROWSER` is unset; panics when it is set.
    pub fn start() -> Option<Browser> {
        let driver = find(
            "SLUICE_CHROMEDRIVER",
            &["chromedriver", "/usr/lib/chromium/chromedriver"],
        );
        let chromium = find(
            "SLUICE_CHROMIUM",
            &["chromium", "chromium-browser", "google-chrome"],
        );
        let (Some(driver), Some(chromium)) = (driver, chromium) else {
            let why = "headless Chromium is not installed (Debian: apt-get install chromium chromium-driver; `make test` does it)";
            if std::env::var_os("SLUICE_REQUIRE_BROWSER").is_some_and(|v| !v.is_empty()) {
                panic!("SLUICE_REQUIRE_BROWSER is set but {why}");
            }
            eprintln!("SKIPPED: {why}; set SLUICE_REQUIRE_BROWSER=1 to make this a failure");
            return None;
        };
        Some(Browser::launch(&driver, &chromium))
    }

    fn launch(driver: &Path, chromium: &Path) -> Browser {
        let dir = temp_dir("sluice-browser-");
        let log = dir.path().join("chromedriver.log");
        let out = File::create(&log).expect("chromedriver log");
        let err = out.try_clone().expect("chromedriver log");
        let mut cmd = Command::new(driver);
        // Port 0: chromedriver picks a free port and prints it.
        cmd.args(["--port=0"])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let mut guard = ChildGuard::spawn("chromedriver", &mut cmd).expect("spawn chromedriver");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let port = loop {
            let text = read_log(&log);
            let port = text.lines().find_map(|l| {
                l.split("started successfully on port ")
                    .nth(1)?
                    .trim()
                    .trim_end_matches('.')
                    .parse::<u16>()
                    .ok()
            });
            if let Some(p) = port {
                break p;
            }
            if let Some(status) = guard.try_wait() {
                panic!("chromedriver exited ({status}) before listening:\n{text}");
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver did not start in time:\n{text}"
            );
            thread::sleep(Duration::from_millis(20));
        };
        let base = format!("http://127.0.0.1:{port}");
        let client = crate::client_builder().build().expect("HTTP client");
        let profile = dir.path().join("profile");
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium.display().to_string(),
                "args": [
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--disable-dev-shm-usage",
                    "--window-size=1280,1600",
                    format!("--user-data-dir={}", profile.display()),
                ],
            },
        }}});
        let res = client
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .and_then(|r| r.json::<Value>())
            .unwrap_or_else(|e| panic!("new session: {e}\n{}", read_log(&log)));
        let session = res["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("new session refused: {res}\n{}", read_log(&log)))
            .to_string();
        Browser {
            base,
            session,
            client,
            _dir: dir,
            _driver: guard,
        }
    }

    /// One WebDriver command; the `value` of its answer. Panics on an error
    /// answer, with it.
    fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.client.request(method, &url);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req
            .send()
            .and_then(|r| r.json())
            .unwrap_or_else(|e| panic!("WebDriver {path}: {e}"));
        if v["value"]["error"].is_string() {
            panic!("WebDriver {path}: {}", v["value"]);
        }
        v["value"].clone()
    }

    /// Navigates to `url` and waits for it to load.
    pub fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url})));
    }

    /// Runs `script` (a function body; `arguments[i]` are `args`) in the
    /// page and returns what it returns.
    pub fn eval(&self, script: &str, args: &[Value]) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
    }

    /// Polls `script` until it returns `true` or `timeout` passes.
    pub fn wait_until(&self, timeout: Duration, script: &str) -> bool {
        crate::wait_for(timeout, || self.eval(script, &[]) == json!(true))
    }

    /// The element matching the CSS `selector`.
    pub fn find(&self, selector: &str) -> String {
        let v = self.call(
            reqwest::Method::POST,
            "/element",
            Some(json!({"using": "css selector", "value": selector})),
        );
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {selector}: {v}"))
            .to_string()
    }

    /// Types `text` into the element, as a user would.
    pub fn type_into(&self, selector: &str, text: &str) {
        let id = self.find(selector);
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            Some(json!({"text": text})),
        );
    }

    /// Clicks the element, as a user would.
    pub fn click(&self, selector: &str) {
        let id = self.find(selector);
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            Some(json!({})),
        );
    }

    /// A PNG of the viewport.
    pub fn screenshot(&self) -> Vec<u8> {
        let v = self.call(reqwest::Method::GET, "/screenshot", None);
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_default())
            .expect("screenshot is base64")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ends Chromium cleanly; the driver's guard then kills the driver.
        let _ = self
            .client
            .delete(format!("{}/session/{}", self.base, self.session))
            .timeout(Duration::from_secs(10))
            .send();
    }
}
