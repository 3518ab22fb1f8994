package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	apitest "k8s.io/cri-api/pkg/apis/testing"
	"k8s.io/klog/v2"
)

// Pod identity labels the kubelet puts on every container.
const (
	labelPodName      = "io.kubernetes.pod.name"
	labelPodNamespace = "io.kubernetes.pod.namespace"
	labelPodUID       = "io.kubernetes.pod.uid"
	labelContainer    = "io.kubernetes.container.name"
)

// runtime is kubemark's fake CRI runtime whose containers can end: the fake
// keeps the sandboxes and containers the kubelet sees; this wrapper starts a
// host process or a timer for a container when the kubelet starts it and
// marks the container exited (with the exit code) when that ends.
type runtime struct {
	*apitest.FakeRuntimeService
	ctx  context.Context
	exec execMap
	node string

	mu      sync.Mutex
	configs map[string]*containerConfig // by container ID, from create to remove
	running map[string]*running         // by container ID, while it runs
}

type containerConfig struct {
	cfg     *runtimeapi.ContainerConfig
	logPath string
}

type running struct {
	cancel context.CancelFunc
	done   chan struct{}
}

func newRuntime(ctx context.Context, fake *apitest.FakeRuntimeService, m execMap, node string) *runtime {
	r := &runtime{FakeRuntimeService: fake, ctx: ctx, exec: m, node: node,
		configs: map[string]*containerConfig{}, running: map[string]*running{}}
	// The fake records every call it gets; drop the record now and then so a
	// long run does not grow without bound.
	go func() {
		t := time.NewTicker(time.Minute)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				fake.Lock()
				fake.Called = nil
				fake.Unlock()
			}
		}
	}()
	return r
}

func (r *runtime) CreateContainer(ctx context.Context, sandboxID string, cfg *runtimeapi.ContainerConfig, sandboxCfg *runtimeapi.PodSandboxConfig) (string, error) {
	id, err := r.FakeRuntimeService.CreateContainer(ctx, sandboxID, cfg, sandboxCfg)
	if err != nil {
		return "", err
	}
	cc := &containerConfig{cfg: cfg}
	if sandboxCfg.GetLogDirectory() != "" && cfg.GetLogPath() != "" {
		cc.logPath = filepath.Join(sandboxCfg.GetLogDirectory(), cfg.GetLogPath())
	}
	r.mu.Lock()
	r.configs[id] = cc
	r.mu.Unlock()
	return id, nil
}

func (r *runtime) StartContainer(ctx context.Context, id string) error {
	if err := r.FakeRuntimeService.StartContainer(ctx, id); err != nil {
		return err
	}
	r.mu.Lock()
	cc := r.configs[id]
	r.mu.Unlock()
	if cc == nil {
		return nil
	}
	work, err := r.workFor(id, cc)
	if err != nil || work == nil {
		if err != nil {
			r.exited(id, 128, "StartError", err.Error())
		}
		return nil
	}
	runCtx, cancel := context.WithCancel(r.ctx)
	run := &running{cancel: cancel, done: make(chan struct{})}
	r.mu.Lock()
	r.running[id] = run
	r.mu.Unlock()
	go func() {
		defer close(run.done)
		code, reason, msg := work(runCtx)
		r.mu.Lock()
		delete(r.running, id)
		r.mu.Unlock()
		r.exited(id, code, reason, msg)
	}()
	return nil
}

// workFor returns what the container does, or nil for a container that runs
// until it is stopped.
func (r *runtime) workFor(id string, cc *containerConfig) (func(context.Context) (int32, string, string), error) {
	cfg := cc.cfg
	argv := append(append([]string{}, cfg.GetCommand()...), cfg.GetArgs()...)
	if base, ok := r.exec[cfg.GetImage().GetImage()]; ok {
		return r.processWork(id, cc, append(append([]string{}, base...), argv...)), nil
	}
	if len(argv) == 2 && filepath.Base(argv[0]) == "sleep" {
		secs, err := strconv.ParseFloat(argv[1], 64)
		if err != nil || secs < 0 {
			return nil, fmt.Errorf("sleep: bad duration %q", argv[1])
		}
		d := time.Duration(secs * float64(time.Second))
		return func(ctx context.Context) (int32, string, string) {
			select {
			case <-time.After(d):
				return 0, "Completed", ""
			case <-ctx.Done():
				return 143, "Error", "stopped"
			}
		}, nil
	}
	return nil, nil
}

// processWork runs argv as a host process standing for the container. The
// container's volume mounts are passed as HCSI_MOUNTS, a JSON object from
// container path to host path, since the process sees the host's
// filesystem.
func (r *runtime) processWork(id string, cc *containerConfig, argv []string) func(context.Context) (int32, string, string) {
	cfg := cc.cfg
	return func(ctx context.Context) (int32, string, string) {
		logger := klog.FromContext(ctx).WithValues("container", id, "pod", cfg.GetLabels()[labelPodNamespace]+"/"+cfg.GetLabels()[labelPodName])
		mounts := map[string]string{}
		for _, m := range cfg.GetMounts() {
			mounts[m.GetContainerPath()] = m.GetHostPath()
		}
		mj, _ := json.Marshal(mounts)
		env := append(os.Environ(),
			"HCSI_MOUNTS="+string(mj),
			"HCSI_NODE_NAME="+r.node,
			"HCSI_POD_NAME="+cfg.GetLabels()[labelPodName],
			"HCSI_POD_NAMESPACE="+cfg.GetLabels()[labelPodNamespace],
			"HCSI_POD_UID="+cfg.GetLabels()[labelPodUID],
			"HCSI_CONTAINER_NAME="+cfg.GetLabels()[labelContainer],
		)
		for _, kv := range cfg.GetEnvs() {
			env = append(env, kv.GetKey()+"="+kv.GetValue())
		}
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = env
		cmd.Dir = "/"
		// Its own process group, and killed if this kubelet dies: a container
		// never outlives its node.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if cc.logPath != "" {
			if err := os.MkdirAll(filepath.Dir(cc.logPath), 0o750); err == nil {
				if f, err := os.OpenFile(cc.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640); err == nil {
					defer f.Close()
					cmd.Stdout, cmd.Stderr = f, f
				}
			}
		}
		if err := cmd.Start(); err != nil {
			logger.Error(err, "container process did not start")
			return 128, "StartError", err.Error()
		}
		waited := make(chan error, 1)
		go func() { waited <- cmd.Wait() }()
		var err error
		select {
		case err = <-waited:
		case <-ctx.Done():
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
			select {
			case err = <-waited:
			case <-time.After(10 * time.Second):
				_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
				err = <-waited
			}
		}
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0, "Completed", ""
		case errors.As(err, &ee):
			code := int32(ee.ExitCode())
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				code = 128 + int32(ws.Signal())
			}
			return code, "Error", err.Error()
		default:
			return 128, "Error", err.Error()
		}
	}
}

// exited marks the container exited in the fake, as a runtime reports a
// container whose process ended; the kubelet's PLEG sees it at its next
// relist.
func (r *runtime) exited(id string, code int32, reason, msg string) {
	r.FakeRuntimeService.Lock()
	defer r.FakeRuntimeService.Unlock()
	c, ok := r.Containers[id]
	if !ok || c.State == runtimeapi.ContainerState_CONTAINER_EXITED {
		return
	}
	c.State = runtimeapi.ContainerState_CONTAINER_EXITED
	c.FinishedAt = time.Now().UnixNano()
	c.ExitCode = code
	c.Reason = reason
	c.Message = msg
}

// StopContainer ends the container's work first (SIGTERM, then SIGKILL after
// the grace period) and answers once it has ended, as a runtime does.
func (r *runtime) StopContainer(ctx context.Context, id string, timeout int64) error {
	r.mu.Lock()
	run := r.running[id]
	r.mu.Unlock()
	if run != nil {
		run.cancel()
		select {
		case <-run.done:
		case <-time.After(time.Duration(timeout)*time.Second + 15*time.Second):
		}
	}
	return r.FakeRuntimeService.StopContainer(ctx, id, timeout)
}

func (r *runtime) RemoveContainer(ctx context.Context, id string) error {
	if err := r.StopContainer(ctx, id, 0); err != nil && !isNotFound(err) {
		return err
	}
	r.mu.Lock()
	delete(r.configs, id)
	r.mu.Unlock()
	return r.FakeRuntimeService.RemoveContainer(ctx, id)
}

// StopPodSandbox stops the sandbox's containers first, as a runtime does.
func (r *runtime) StopPodSandbox(ctx context.Context, sandboxID string) error {
	r.FakeRuntimeService.Lock()
	var ids []string
	for id, c := range r.Containers {
		if c.SandboxID == sandboxID {
			ids = append(ids, id)
		}
	}
	r.FakeRuntimeService.Unlock()
	for _, id := range ids {
		_ = r.StopContainer(ctx, id, 0)
	}
	return r.FakeRuntimeService.StopPodSandbox(ctx, sandboxID)
}

func (r *runtime) stopAll() {
	r.mu.Lock()
	var runs []*running
	for _, run := range r.running {
		runs = append(runs, run)
	}
	r.mu.Unlock()
	for _, run := range runs {
		run.cancel()
	}
	for _, run := range runs {
		<-run.done
	}
}

func isNotFound(err error) bool {
	return err != nil && strings.Contains(err.Error(), "not found")
}
