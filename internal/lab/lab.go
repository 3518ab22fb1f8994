// Package lab runs the local Harvester-in-a-box lab (`make lab`): a simulated
// Harvester host with loop-device disks, a real guest control plane, the
// driver as separate OS processes, the real kubelet per guest node, and the
// workload of Harvester issue 9761 (databases and backup CronJobs), while
// checking the invariants all the time and at the end, and writing a report.
//
// Subpackages: host and guest start the two clusters, proc runs processes,
// chart reads the rendered chart, nodetap sits between kubelets and node
// plugins, workload and agent make and run the workload, monitor measures,
// invariants checks.
package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/workload"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest/chart"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest/nodetap"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// Run runs the lab once and returns its report (also written to Out). The
// report says whether the run passed; err is for a lab that could not run.
func Run(ctx context.Context, c Config) (*Report, error) {
	r := &run{c: c, start: time.Now(), seen: map[string]bool{}}
	return r.run(ctx)
}

type run struct {
	c     Config
	start time.Time
	log   klog.Logger

	h       *simhost.Host
	g       *simguest.Guest
	mon     *monitor.Monitor
	wl      *workload.Workload
	nodes   []string
	results string
	sockets string

	mu         sync.Mutex
	violations []invariants.Violation
	seen       map[string]bool
	taps       tapCounts
	expansions []monitor.Sample
	// unstarted are the pods that never ran, taken when the run ends.
	unstarted []string
	inflight  []InFlight
	phase     string
	// faults are the host faults played, in their order.
	faults []FaultEvent
	// hostPath times the host's part of each hot-plug (with host nodes).
	hostPath *hostPath
}

// startMonitor starts the guest's monitor and, with host nodes, the host
// path's watch and the classification of each attach and detach by where
// the host had the volume.
func (r *run) startMonitor(ctx context.Context) error {
	var err error
	if r.h.Longhorn == nil {
		r.mon, err = monitor.Start(ctx, r.g.Kube)
		return err
	}
	if r.hostPath, err = startHostPath(ctx, r.h.Kube); err != nil {
		return err
	}
	r.mon, err = monitor.StartClassified(ctx, r.g.Kube, r.classifier(ctx))
	return err
}

type tapCounts struct {
	calls, skipped, failed int
	// missingTool counts failures of a command this machine lacks.
	missingTool    int
	missingToolErr string
}

func (r *run) violate(vs ...invariants.Violation) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, v := range vs {
		if r.seen[v.Key()] {
			continue
		}
		r.seen[v.Key()] = true
		r.violations = append(r.violations, v)
		r.log.Info("INVARIANT VIOLATED", "kind", v.Kind, "volume", v.Volume, "nodes", v.Nodes, "details", v.Details)
	}
}

func (r *run) setPhase(p string) {
	r.mu.Lock()
	r.phase = p
	r.mu.Unlock()
	r.log.Info("lab phase", "phase", p)
}

func (r *run) run(ctx context.Context) (rep *Report, err error) {
	c := &r.c
	r.log = klog.FromContext(ctx)
	if err := os.MkdirAll(filepath.Join(c.Out, "logs"), 0o750); err != nil {
		return nil, err
	}
	if c.Bin == "" {
		if c.Bin, err = testenv.BinDir(); err != nil {
			return nil, err
		}
	}
	m, err := chart.Load(c.Manifests)
	if err != nil {
		return nil, err
	}
	simOpts, err := c.simOptions()
	if err != nil {
		return nil, err
	}
	if err := preflight(c.neededTools(c.databasesUseXFS()), lookPath); err != nil {
		return nil, err
	}
	r.results = filepath.Join(c.Out, "results")
	if err := os.MkdirAll(r.results, 0o750); err != nil {
		return nil, err
	}
	// Unix socket paths are short: sockets and kubelet roots live in a short
	// temporary directory, linked from the run directory.
	if r.sockets, err = os.MkdirTemp("", "hcsi-lab-"); err != nil {
		return nil, err
	}
	_ = os.Symlink(r.sockets, filepath.Join(c.Out, "nodes"))
	defer r.cleanup(ctx)

	r.setPhase("host")
	for i := range c.Nodes {
		r.nodes = append(r.nodes, fmt.Sprintf("node-%d", i))
	}
	if err := c.CheckHostFaults(); err != nil {
		return nil, err
	}
	ho, gaps, err := c.host(simOpts, r.nodes)
	if err != nil {
		return nil, err
	}
	for _, g := range gaps {
		r.log.Info("Known gap of the real control plane for this Harvester release", "harvester", c.Harvester, "tag", ho.Real, "release", ho.RealRelease, "gap", g)
	}
	if r.h, err = simhost.Start(ctx, ho); err != nil {
		return nil, err
	}
	r.setPhase("guest")
	status := max(time.Second, c.scaled(10*time.Second))
	r.g, err = simguest.Start(ctx, simguest.Options{
		Dir: filepath.Join(c.Out, "guest"), SocketDir: r.sockets, LogDir: filepath.Join(c.Out, "logs"), Bin: c.Bin,
		DriverBinary: c.DriverBinary, ControllerBinary: c.ControllerBinary,
		AgentBinary: c.AgentCommand, AgentImage: AgentImage, AgentEnv: []string{"HCSI_LAB_RESULTS=" + r.results},
		Manifests: m, Host: r.h, NodeStatusUpdate: status, KubeletSyncFrequency: status,
		SkipUnstage: c.SkipUnstage, Seed: c.Seed, OnNodeCall: r.nodeCall,
		ContainerRestartDelay: max(time.Second, c.scaled(10*time.Second)),
		InCluster:             c.PrivateMountNamespace,
	})
	if err != nil {
		return nil, err
	}
	for _, n := range r.nodes {
		if _, err := r.g.AddNode(ctx, n); err != nil {
			return nil, fmt.Errorf("guest node %s: %w", n, err)
		}
	}
	readyCtx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	err = r.g.WaitNodesReady(readyCtx, r.nodes)
	cancel()
	if err != nil {
		return nil, err
	}
	if err := r.startMonitor(ctx); err != nil {
		return nil, err
	}

	r.setPhase("workload")
	dbClass, err := r.dbStorageClass(ctx, m.StorageClass)
	if err != nil {
		return nil, err
	}
	r.wl = workload.New(r.g.Kube, workload.Options{
		Namespaces: c.Namespaces, Nodes: r.nodes, StorageClass: m.StorageClass.Name, DBStorageClass: dbClass, Image: AgentImage,
		DBInterval: max(200*time.Millisecond, c.scaled(2*time.Second)), BackupWork: c.scaled(10 * time.Second),
		LabJobs: c.LabJobs, JobInterval: c.JobInterval, MoveInterval: c.MoveInterval, Seed: c.Seed,
		ExpandInterval: c.ExpandEvery, ExpandStep: resource.MustParse("512Mi"), ExpandTimeout: c.StuckBound,
		OnExpansion: r.expanded,
	})
	if err := r.wl.Create(ctx); err != nil {
		return nil, err
	}
	runCtx, stopRun := context.WithTimeout(ctx, time.Duration(c.Minutes*float64(time.Minute)))
	defer stopRun()
	var bg sync.WaitGroup
	bgCtx, stopBG := context.WithCancel(ctx)
	defer func() { stopBG(); bg.Wait() }()
	bg.Add(3)
	go func() { defer bg.Done(); r.wl.RunUntil(runCtx, bgCtx) }()
	go func() { defer bg.Done(); r.checkLoop(bgCtx) }()
	go func() { defer bg.Done(); r.progressLoop(bgCtx) }()
	r.startFaults(runCtx, &bg)
	<-runCtx.Done()
	if ctx.Err() != nil {
		return r.report(ctx, "interrupted")
	}
	unstarted := r.mon.NeverStarted(time.Now().Add(-c.startGrace()))
	r.mu.Lock()
	r.unstarted = unstarted
	r.mu.Unlock()

	r.setPhase("quiesce")
	qctx, cancelQ := context.WithTimeout(context.WithoutCancel(ctx), max(5*time.Minute, 2*c.StuckBound))
	defer cancelQ()
	if err := r.quiesce(qctx); err != nil {
		r.violate(invariants.Violation{Kind: invariants.KindStuck, At: time.Now(), Details: "quiescing did not finish: " + err.Error()})
	}
	stopBG()
	bg.Wait()
	r.finalChecks(qctx)
	return r.report(ctx, "done")
}

// dbStorageClass is the databases' StorageClass: the chart's, except when
// claims are expanded on a machine whose processes lack CAP_SYS_RESOURCE
// (some sandboxes drop it; the chart's node plugin is privileged): ext4 cannot
// grow while mounted there, and the kubelet always expands a CSI volume
// mounted, so the databases get a copy of the chart's class whose
// filesystem is XFS, which grows with CAP_SYS_ADMIN.
func (r *run) dbStorageClass(ctx context.Context, chartClass *storagev1.StorageClass) (string, error) {
	if !r.c.databasesUseXFS() {
		return chartClass.Name, nil
	}
	sc := chartClass.DeepCopy()
	sc.Name += "-xfs"
	sc.ResourceVersion, sc.UID = "", ""
	delete(sc.Annotations, "storageclass.kubernetes.io/is-default-class")
	if sc.Parameters == nil {
		sc.Parameters = map[string]string{}
	}
	sc.Parameters["csi.storage.k8s.io/fstype"] = "xfs"
	if _, err := r.g.Kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("StorageClass %s: %w", sc.Name, err)
	}
	r.c.DBFSType = "xfs"
	r.log.Info("this machine drops CAP_SYS_RESOURCE, so a mounted ext4 cannot grow: the databases' claims use XFS", "storageClass", sc.Name)
	return sc.Name, nil
}

// quiesce suspends the CronJobs, waits for running Jobs, deletes the
// workload and waits until no VolumeAttachment is left.
func (r *run) quiesce(ctx context.Context) error {
	if err := r.wl.Suspend(ctx); err != nil {
		return err
	}
	if err := r.wl.WaitJobsDone(ctx); err != nil {
		return fmt.Errorf("backup Jobs still running: %w", err)
	}
	if err := r.wl.Delete(ctx); err != nil {
		return fmt.Errorf("workload namespaces not gone: %w", err)
	}
	return wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		s := r.mon.Snapshot()
		return s.Attaching+s.Detaching == 0 && len(r.mon.Pending()) == 0 && r.noVAs(ctx), nil
	})
}

func (r *run) noVAs(ctx context.Context) bool {
	vas, err := r.g.Kube.StorageV1().VolumeAttachments().List(ctx, metav1ListAll)
	return err == nil && len(vas.Items) == 0
}

// expanded records a claim expansion's end: its latency, or a stuck
// expansion.
func (r *run) expanded(e workload.Expansion) {
	vol := e.Namespace + "/" + e.Claim
	if e.Err != nil {
		r.violate(invariants.Violation{Kind: invariants.KindStuck, At: time.Now(), Volume: vol, Nodes: []string{e.Node},
			Details: fmt.Sprintf("expansion from %s to %s asked at %s: %v", e.From.String(), e.To.String(), e.Requested.Format(time.TimeOnly), e.Err)})
		return
	}
	d := e.Done.Sub(e.Requested)
	r.mu.Lock()
	r.expansions = append(r.expansions, monitor.Sample{At: e.Done, Seconds: d.Seconds(), D: d})
	r.mu.Unlock()
	r.log.V(2).Info("claim expanded", "volume", vol, "node", e.Node, "to", e.To.String(), "seconds", d.Seconds())
}

func (r *run) nodeCall(c nodetap.Call) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.taps.calls++
	if c.Skipped {
		r.taps.skipped++
		r.log.Info("fault: NodeUnstageVolume not passed to the driver", "node", c.Node, "volume", c.Volume)
	}
	if c.Err != nil {
		r.taps.failed++
		if msg := c.Err.Error(); strings.Contains(msg, exec.ErrNotFound.Error()) {
			r.taps.missingTool++
			if r.taps.missingToolErr == "" {
				r.taps.missingToolErr = msg
			}
		}
	}
}

// cleanup stops everything and removes every mount and loop device the run
// made, whatever happened.
func (r *run) cleanup(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	if r.g != nil {
		if err := r.g.Stop(ctx); err != nil {
			r.log.Error(err, "stopping the guest")
		}
	}
	if r.sockets != "" {
		if err := UnmountUnder(r.sockets); err != nil {
			r.log.Error(err, "unmounting the guest nodes' mounts")
		}
	}
	if r.h != nil {
		if err := r.h.Stop(ctx); err != nil {
			r.log.Error(err, "stopping the host")
		}
	}
	if err := DetachLoopDevices(filepath.Join(r.c.Out, "host", "backing")); err != nil {
		r.log.Error(err, "detaching loop devices")
	}
	if r.sockets != "" {
		_ = os.Remove(filepath.Join(r.c.Out, "nodes"))
		if err := os.RemoveAll(r.sockets); err != nil {
			r.log.Error(err, "removing the node directories")
		}
	}
	// Backing files are big sparse files: not worth keeping.
	_ = os.RemoveAll(filepath.Join(r.c.Out, "host", "backing"))
}

// UnmountUnder unmounts every mount at or below dir, deepest first.
func UnmountUnder(dir string) error {
	var errs []error
	for range 3 {
		mounts, err := readMounts()
		if err != nil {
			return err
		}
		var points []string
		for _, m := range mounts {
			if m.point == dir || strings.HasPrefix(m.point, dir+"/") {
				points = append(points, m.point)
			}
		}
		if len(points) == 0 {
			return nil
		}
		errs = nil
		for i := len(points) - 1; i >= 0; i-- {
			if err := syscall.Unmount(points[i], syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("umount %s: %w", points[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// DetachLoopDevices detaches every loop device whose backing file is under
// dir.
func DetachLoopDevices(dir string) error {
	if d, err := filepath.EvalSymlinks(dir); err == nil {
		dir = d
	}
	var errs []error
	for _, dev := range loopDevicesOn(dir) {
		if err := detachLoop(dev); err != nil {
			errs = append(errs, fmt.Errorf("detach %s: %w", dev, err))
		}
	}
	return errors.Join(errs...)
}
