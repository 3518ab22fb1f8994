package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

func TestUpstreamFlagsAndEnvironment(t *testing.T) {
	t.Setenv("HOST_STORAGE_CLASS", "longhorn-ssd")
	t.Setenv("DEBUG", "true")
	o, err := parseFlags([]string{"--endpoint=unix:///csi/other.sock", "--nodeid=vm-1", "--kubeconfig=/var/lib/harvester/cloud-provider-config"})
	if err != nil {
		t.Fatal(err)
	}
	if o.endpoint != "unix:///csi/other.sock" || o.nodeID != "vm-1" || o.kubeconfig != "/var/lib/harvester/cloud-provider-config" {
		t.Errorf("flags not taken: %+v", o)
	}
	if o.hostStorageClass != "longhorn-ssd" || !o.debug {
		t.Errorf("environment defaults not taken: class %q debug %v", o.hostStorageClass, o.debug)
	}
	o, err = parseFlags([]string{"--host-storage-class=explicit", "--batch-window=1s", "--mode=controller"})
	if err != nil {
		t.Fatal(err)
	}
	if o.hostStorageClass != "explicit" || o.queue.BatchWindow != time.Second || o.mode != "controller" {
		t.Errorf("flag must beat the environment and queue flags must apply: %+v", o)
	}
}

func TestDefaults(t *testing.T) {
	t.Setenv("HOST_STORAGE_CLASS", "")
	t.Setenv("DEBUG", "")
	o, err := parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.endpoint != "unix:///csi/csi.sock" || o.mode != "all" || o.backend != "auto" || o.debug {
		t.Errorf("defaults: %+v", o)
	}
	// The guard waits as long as the attach/detach controller's own force
	// detach bound; the guest client is the pod's own; the monitor runs.
	if o.detachGuardTimeout != 6*time.Minute || o.guestKubeconfig != "" || !o.nodeMonitor {
		t.Errorf("guest defaults: guard %s, guest kubeconfig %q, monitor %v", o.detachGuardTimeout, o.guestKubeconfig, o.nodeMonitor)
	}
}

// TestDefaultPublishWaitFreesTheAttachersDefaultWorkers: upstream's chart
// (and RKE2's copy of it) starts the driver without --publish-wait and the
// external-attacher without --worker-threads, so 10 workers (external-attacher
// v4.12.0 cmd/csi-attacher/main.go). A publish that waits for KubeVirt holds
// its worker; the default must answer "in progress" before a crowd of
// waiting calls can take every one of those 10.
func TestDefaultPublishWaitFreesTheAttachersDefaultWorkers(t *testing.T) {
	const attacherDefaultWorkers = 10
	o, err := parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.publishWait <= 0 {
		t.Errorf("--publish-wait defaults to %s: every publish holds an attacher worker up to its deadline", o.publishWait)
	}
	if o.publishWaitCrowd < 1 || o.publishWaitCrowd >= attacherDefaultWorkers {
		t.Errorf("--publish-wait-crowd defaults to %d, want 1 to %d: the attacher's %d workers could all wait", o.publishWaitCrowd, attacherDefaultWorkers-1, attacherDefaultWorkers)
	}
	o, err = parseFlags([]string{"--publish-wait=0", "--publish-wait-crowd=1"})
	if err != nil {
		t.Fatal(err)
	}
	if o.publishWait != 0 || o.publishWaitCrowd != 1 {
		t.Errorf("publish wait flags not taken: wait %s crowd %d", o.publishWait, o.publishWaitCrowd)
	}
}

// --wedged-after reaches the queue, and its default is the queue's.
func TestWedgedAfterFlag(t *testing.T) {
	o, err := parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.queue.WedgedAfter != hotplug.DefaultWedgedAfter {
		t.Errorf("default --wedged-after %s, want %s", o.queue.WedgedAfter, hotplug.DefaultWedgedAfter)
	}
	if o, err = parseFlags([]string{"--wedged-after=90s"}); err != nil || o.queue.WedgedAfter != 90*time.Second {
		t.Errorf("--wedged-after=90s: %v, %+v", err, o)
	}
}

// --one-removal-at-a-time is on by default (the strategy safe for every
// shipped KubeVirt) and an operator can turn it off.
func TestOneRemovalPerAttachmentPodFlag(t *testing.T) {
	o, err := parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.queue.Strategy != hotplug.AutoStrategy() {
		t.Errorf("default strategy %+v, want %+v", o.queue.Strategy, hotplug.AutoStrategy())
	}
	if o, err = parseFlags([]string{"--one-removal-at-a-time=false"}); err != nil || o.queue.Strategy.OneRemovalAtATime || o.queue.Strategy.Name != "operator" {
		t.Errorf("--one-removal-at-a-time=false: %v, %+v", err, o)
	}
}

func TestGuestFlags(t *testing.T) {
	o, err := parseFlags([]string{"--guest-kubeconfig=/etc/guest.yaml", "--detach-guard-timeout=0", "--node-monitor=false",
		"--orphan-reconciler=false", "--orphan-grace=5m"})
	if err != nil {
		t.Fatal(err)
	}
	if o.guestKubeconfig != "/etc/guest.yaml" || o.detachGuardTimeout != 0 || o.nodeMonitor || o.orphans || o.orphanGrace != 5*time.Minute {
		t.Errorf("guest flags not taken: %+v", o)
	}
}

func TestBadCommandLinesAreClearErrors(t *testing.T) {
	for args, want := range map[string]string{
		"--no-such-flag":             "no-such-flag",
		"--mode=everything":          "invalid --mode",
		"stray":                      "unexpected arguments",
		"--batch-window=x":           "batch-window",
		"--detach-guard-timeout=-1s": "invalid --detach-guard-timeout",
		"--hotplug-backend=x":        "invalid --hotplug-backend",
		"--logging-format=xml":       "invalid --logging-format",
		"--publish-wait=-1s":         "invalid --publish-wait",
		"--publish-wait-crowd=0":     "invalid --publish-wait-crowd",
		"--orphan-grace=0s":          "invalid --orphan-grace",
		"--wedged-after=0s":          "invalid --wedged-after",
	} {
		_, err := parseFlags([]string{args})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want an error mentioning %q", args, err, want)
		}
	}
}

// TestMain lets the tests run this test binary as the driver itself
// (HCSI_RUN_MAIN=1): the command line is then checked end to end, exit code,
// stdout and stderr, exactly as a user or the kubelet sees them.
func TestMain(m *testing.M) {
	if os.Getenv("HCSI_RUN_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type result struct {
	code           int
	stdout, stderr string
}

// runDriver runs the driver with args and returns how it ended.
func runDriver(t *testing.T, args ...string) result {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.Env = append(os.Environ(), "HCSI_RUN_MAIN=1", "DEBUG=", "HOST_STORAGE_CLASS=")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	code := 0
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		t.Fatalf("run the driver %v: %v", args, err)
	}
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// klog's file-logging flags that --help must not list.
var klogOnlyFlags = []string{"logtostderr", "alsologtostderr", "log_dir", "log_file", "log_file_max_size",
	"add_dir_header", "skip_headers", "skip_log_headers", "stderrthreshold", "one_output", "log_backtrace_at", "vmodule"}

func TestHelpListsTheDriversFlags(t *testing.T) {
	r := runDriver(t, "--help")
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("--help: exit %d, stderr %q", r.code, r.stderr)
	}
	for _, f := range []string{"endpoint", "nodeid", "kubeconfig", "host-storage-class", "debug", "mode", "hotplug-backend",
		"batch-window", "hotplug-qps", "metrics-address", "sysfs-root", "sweep-interval", "version", "v"} {
		if !regexp.MustCompile(`(?m)^\s+--` + regexp.QuoteMeta(f) + `\b`).MatchString(r.stdout) {
			t.Errorf("--help does not list --%s:\n%s", f, r.stdout)
		}
	}
	for _, f := range klogOnlyFlags {
		if strings.Contains(r.stdout, f) {
			t.Errorf("--help lists klog's --%s", f)
		}
	}
	driverFlags := 0
	newFlagSet(&options{}).VisitAll(func(*flag.Flag) { driverFlags++ })
	if n := strings.Count(r.stdout, "\n  --"); n != driverFlags {
		t.Errorf("--help lists %d flags; the driver defines %d", n, driverFlags)
	}
}

func TestVerbosityStaysReachable(t *testing.T) {
	if _, err := parseFlags([]string{"--v=5"}); err != nil {
		t.Fatalf("--v: %v", err)
	}
	if !klog.V(5).Enabled() || klog.V(6).Enabled() {
		t.Error("--v=5 did not set klog's verbosity")
	}
	if _, err := parseFlags([]string{"--debug"}); err != nil {
		t.Fatal(err)
	}
	if !klog.V(4).Enabled() || klog.V(5).Enabled() {
		t.Error("--debug did not set verbosity 4")
	}
	if _, err := parseFlags([]string{"--debug", "--v=6"}); err != nil {
		t.Fatal(err)
	}
	if !klog.V(6).Enabled() {
		t.Error("--debug overrode an explicit --v=6")
	}
	if _, err := parseFlags([]string{"--v=0"}); err != nil {
		t.Fatal(err)
	}
}

func TestUnknownFlagIsOneShortError(t *testing.T) {
	r := runDriver(t, "--no-such-flag")
	if r.code != 2 || r.stdout != "" {
		t.Errorf("exit %d (want 2), stdout %q", r.code, r.stdout)
	}
	if n := strings.Count(r.stderr, "no-such-flag"); n != 1 {
		t.Errorf("the error names the flag %d times, want once:\n%s", n, r.stderr)
	}
	if lines := strings.Count(strings.TrimSpace(r.stderr), "\n") + 1; lines > 2 || strings.Contains(r.stderr, "--endpoint") {
		t.Errorf("the error is %d lines or carries the usage; want one line and a hint:\n%s", lines, r.stderr)
	}
	if !strings.Contains(r.stderr, "--help") {
		t.Errorf("the error does not point at --help:\n%s", r.stderr)
	}
}

func TestVersionIsLabeled(t *testing.T) {
	r := runDriver(t, "--version")
	if r.code != 0 {
		t.Fatalf("--version: exit %d\n%s", r.code, r.stderr)
	}
	for _, want := range []string{"version: " + version, "commit: ", "go: " + runtime.Version()} {
		if !strings.Contains(r.stdout, want+"") {
			t.Errorf("--version printed %q, want a line %q", r.stdout, want)
		}
	}
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		if k, v, ok := strings.Cut(line, ": "); !ok || k == "" || strings.TrimSpace(v) == "" {
			t.Errorf("unlabeled or empty line %q in --version", line)
		}
	}
}

// A bad --hotplug-backend must be caught before anything touches the host:
// the kubeconfig given here does not exist, and the error must be about the
// backend.
func TestBadBackendIsCaughtAtParsing(t *testing.T) {
	r := runDriver(t, "--mode=controller", "--hotplug-backend=fastest", "--kubeconfig=/nonexistent/cloud-provider-config")
	if r.code != 2 {
		t.Errorf("exit %d, want 2 (a command-line error)", r.code)
	}
	if !strings.Contains(r.stderr, "--hotplug-backend") || !strings.Contains(r.stderr, "fastest") || strings.Contains(r.stderr, "kubeconfig") {
		t.Errorf("want an error about --hotplug-backend only:\n%s", r.stderr)
	}
}

func TestMissingKubeconfigErrorNamesTheFlag(t *testing.T) {
	if _, err := os.Stat(host.DefaultKubeconfig); err == nil {
		t.Skipf("%s exists on this machine: the driver would use it", host.DefaultKubeconfig)
	}
	sock := filepath.Join(t.TempDir(), "csi.sock")
	r := runDriver(t, "--mode=controller", "--endpoint=unix://"+sock, "--kubeconfig=/nonexistent/cloud-provider-config")
	if r.code == 0 {
		t.Fatal("the driver started without a host kubeconfig")
	}
	if !strings.Contains(r.stderr, "--kubeconfig /nonexistent/cloud-provider-config") || !strings.Contains(r.stderr, host.DefaultKubeconfig) {
		t.Errorf("the error must name --kubeconfig, its value and the fallback:\n%s", r.stderr)
	}
}

// The chart always passes --kubeconfig; on a node that only has upstream's
// /etc/kubernetes/cloud-config the driver must use that, and say so.
func TestKubeconfigFallsBackAndLogsTheFile(t *testing.T) {
	dir := t.TempDir()
	given := filepath.Join(dir, "cloud-provider-config")
	fallback := filepath.Join(dir, "cloud-config")
	if err := os.WriteFile(fallback, []byte("apiVersion: v1\nkind: Config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	logged := func(given string) (string, string) {
		logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
		got := hostKubeconfig(klog.NewContext(context.Background(), logger), given, fallback)
		return got, logger.GetSink().(ktesting.Underlier).GetBuffer().String()
	}

	got, logs := logged(given)
	if got != fallback {
		t.Errorf("--kubeconfig missing: resolved %q, want the fallback %q", got, fallback)
	}
	if !strings.Contains(logs, fallback) || !strings.Contains(logs, given) {
		t.Errorf("the log does not say that %s replaced %s:\n%s", fallback, given, logs)
	}

	got, logs = logged("")
	if got != fallback || !strings.Contains(logs, fallback) {
		t.Errorf("no --kubeconfig: resolved %q (want %q), log:\n%s", got, fallback, logs)
	}

	if err := os.WriteFile(given, []byte("apiVersion: v1\nkind: Config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, logs = logged(given)
	if got != given || !strings.Contains(logs, given) || strings.Contains(logs, fallback) {
		t.Errorf("--kubeconfig present: resolved %q (want %q), log:\n%s", got, given, logs)
	}

	// Neither file: the flag stays as given, the loader reports the error.
	_ = os.Remove(given)
	_ = os.Remove(fallback)
	got, logs = logged(given)
	if got != given || !strings.Contains(logs, "--kubeconfig") {
		t.Errorf("no file: resolved %q (want %q unchanged), log:\n%s", got, given, logs)
	}
}

// --logging-format=json writes every line as the JSON Kubernetes'
// components write, at the verbosity asked for.
func TestJSONLogs(t *testing.T) {
	if _, err := os.Stat(host.DefaultKubeconfig); err == nil {
		t.Skipf("%s exists on this machine: the driver would use it", host.DefaultKubeconfig)
	}
	sock := filepath.Join(t.TempDir(), "csi.sock")
	r := runDriver(t, "--logging-format=json", "--debug", "--mode=controller", "--endpoint=unix://"+sock, "--kubeconfig=/nonexistent/config")
	lines := strings.Split(strings.TrimSpace(r.stderr), "\n")
	if len(lines) < 2 {
		t.Fatalf("too few log lines:\n%s", r.stderr)
	}
	for _, l := range lines {
		var entry map[string]any
		if err := json.Unmarshal([]byte(l), &entry); err != nil {
			t.Fatalf("not a JSON log line: %q (%v)", l, err)
		}
		if _, ok := entry["msg"]; !ok {
			t.Errorf("JSON line without msg: %q", l)
		}
	}
	if !strings.Contains(r.stderr, `"msg":"Starting harvester-csi-driver"`) {
		t.Errorf("no start line in:\n%s", r.stderr)
	}
}
