// Command hollow-kubelet runs the real kubelet (k8s.io/kubernetes/pkg/kubelet:
// volume manager, CSI volume plugin, plugin registry, node status, pod
// lifecycle) as one guest node of the lab, over a container runtime that runs
// no containers. It is kubemark's hollow node with the changes the lab needs:
//
//   - controller attach/detach is on, so the attach/detach controller in
//     kube-controller-manager creates the VolumeAttachments and the kubelet
//     reports volumesInUse and waits for volumesAttached, as on a real node;
//   - the kubelet's own mounter, host utilities and subpath handling are the
//     real ones (kubemark fakes them), so the CSI plugin's staging and
//     publish directories are real and the mounts the driver makes are seen;
//   - containers can run: an image listed in --exec runs the given command as
//     a host process (with the container's args, its volume mounts' host paths
//     in HCSI_MOUNTS, and the pod's identity in the environment) and the
//     container exits when the process does, with its exit code; a container
//     whose command is "sleep N" exits after N seconds; any other container
//     runs until it is stopped, as in kubemark;
//   - a container is ready once it runs (with kubemark's prober every
//     container is ready at once, even one whose volumes are not mounted);
//   - the node can report a machine size (--cores, --memory,
//     --ephemeral-storage) and device plugins' resources (--device).
//
// Everything else (cadvisor, the container manager, the image service) is
// kubemark's fake.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	apitest "k8s.io/cri-api/pkg/apis/testing"
	"k8s.io/klog/v2"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/cm"
	"k8s.io/kubernetes/pkg/kubemark"
	"k8s.io/kubernetes/pkg/volume/util/hostutil"
	"k8s.io/kubernetes/pkg/volume/util/subpath"
	"k8s.io/mount-utils"
)

type options struct {
	kubeconfig     string
	nodeName       string
	rootDir        string
	nodeIP         string
	maxPods        int
	statusUpdate   time.Duration
	syncFrequency  time.Duration
	exec           execMap
	labels         string
	apiQPS         float64
	apiBurst       int
	containerLogs  string
	runtimeTimeout time.Duration
	cores          int
	memory         string
	disk           string
	devices        deviceMap
}

// execMap is --exec IMAGE=COMMAND, repeatable.
type execMap map[string][]string

func (m execMap) String() string { return fmt.Sprint(map[string][]string(m)) }

func (m execMap) Set(v string) error {
	img, cmd, ok := strings.Cut(v, "=")
	if !ok || img == "" || strings.TrimSpace(cmd) == "" {
		return fmt.Errorf("want IMAGE=COMMAND, got %q", v)
	}
	m[img] = strings.Fields(cmd)
	return nil
}

func main() {
	o := options{exec: execMap{}, devices: deviceMap{}}
	fs := flag.NewFlagSet("hollow-kubelet", flag.ExitOnError)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "guest cluster kubeconfig")
	fs.StringVar(&o.nodeName, "node-name", "", "node name")
	fs.StringVar(&o.rootDir, "root-dir", "", "kubelet root directory (pods, plugins, plugins_registry)")
	fs.StringVar(&o.nodeIP, "node-ip", "", "node address (default: the kubelet's choice, the host's; it cannot be a loopback address)")
	fs.IntVar(&o.maxPods, "max-pods", 250, "pods this node takes")
	fs.DurationVar(&o.statusUpdate, "node-status-update-frequency", 10*time.Second, "how often the kubelet posts node status (volumesInUse goes out with it)")
	fs.DurationVar(&o.syncFrequency, "sync-frequency", 10*time.Second, "kubelet pod sync period")
	fs.Var(o.exec, "exec", "IMAGE=COMMAND: containers of IMAGE run COMMAND (plus the container's command and args) as a host process (repeatable)")
	fs.StringVar(&o.labels, "node-labels", "", "comma-separated key=value node labels")
	fs.Float64Var(&o.apiQPS, "kube-api-qps", 50, "API client QPS")
	fs.IntVar(&o.apiBurst, "kube-api-burst", 100, "API client burst")
	fs.DurationVar(&o.runtimeTimeout, "runtime-request-timeout", 2*time.Minute, "runtime request timeout")
	fs.IntVar(&o.cores, "cores", 0, "CPU cores the node reports (0: kubemark's 1)")
	fs.StringVar(&o.memory, "memory", "", "memory the node reports, a quantity (empty: kubemark's 3.75 GB)")
	fs.StringVar(&o.disk, "ephemeral-storage", "", "root filesystem the node reports, a quantity (empty: none, as kubemark)")
	fs.Var(o.devices, "device", "NAME=COUNT: an extended resource the node reports as a device plugin's (repeatable)")
	klog.InitFlags(fs)
	_ = fs.Parse(os.Args[1:])
	if o.kubeconfig == "" || o.nodeName == "" || o.rootDir == "" {
		fmt.Fprintln(os.Stderr, "hollow-kubelet: --kubeconfig, --node-name and --root-dir are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := run(ctx, o); err != nil {
		klog.ErrorS(err, "hollow-kubelet failed")
		klog.Flush()
		os.Exit(1)
	}
}

func run(ctx context.Context, o options) error {
	root, err := filepath.Abs(o.rootDir)
	if err != nil {
		return err
	}
	// kubemark's config helper makes scratch directories under TMPDIR; keep
	// them in this node's directory.
	scratch := filepath.Join(root, "scratch")
	if err := os.MkdirAll(scratch, 0o750); err != nil {
		return err
	}
	_ = os.Setenv("TMPDIR", scratch)

	loaded, err := clientcmd.LoadFromFile(o.kubeconfig)
	if err != nil {
		return err
	}
	cfg, err := clientcmd.NewDefaultClientConfig(*loaded, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = float32(o.apiQPS), o.apiBurst
	cfg.UserAgent = "hollow-kubelet/" + o.nodeName
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}

	labels := map[string]string{}
	for _, kv := range strings.Split(o.labels, ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			labels[k] = v
		}
	}
	f, c := kubemark.GetHollowKubeletConfig(&kubemark.HollowKubeletOptions{
		NodeName:   o.nodeName,
		MaxPods:    o.maxPods,
		NodeLabels: labels,
	})
	f.RootDirectory = root
	f.NodeIP = o.nodeIP
	c.StaticPodPath = filepath.Join(root, "static-pods")
	c.PodLogsDir = filepath.Join(root, "pod-logs")
	for _, d := range []string{c.StaticPodPath, c.PodLogsDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}
	// What kubemark changes and the lab needs real: the attach/detach
	// controller decides attachments, and no kubelet server (several kubelets
	// share the host's ports).
	c.EnableControllerAttachDetach = true
	c.EnableServer = false
	c.ReadOnlyPort = 0
	c.HealthzPort = 0
	c.NodeStatusUpdateFrequency.Duration = o.statusUpdate
	c.SyncFrequency.Duration = o.syncFrequency
	c.RuntimeRequestTimeout.Duration = o.runtimeTimeout

	heartbeatCfg := *cfg
	heartbeatCfg.Timeout = c.NodeStatusUpdateFrequency.Duration
	if lease := time.Duration(c.NodeLeaseDurationSeconds) * time.Second; heartbeatCfg.Timeout > lease {
		heartbeatCfg.Timeout = lease
	}
	heartbeatCfg.QPS = -1
	heartbeat, err := kubernetes.NewForConfig(&heartbeatCfg)
	if err != nil {
		return err
	}

	fake := apitest.NewFakeRuntimeService()
	// A runtime that reports itself ready, as kubemark's fake remote runtime
	// does when it starts serving.
	fake.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	rt := newRuntime(ctx, fake, o.exec, o.nodeName)
	defer rt.stopAll()
	images := apitest.NewFakeImageService()

	mach, err := newMachine(o)
	if err != nil {
		return err
	}
	var cmgr cm.ContainerManager = cm.NewStubContainerManager()
	if len(o.devices) > 0 {
		cmgr = cm.NewStubContainerManagerWithDevicePluginResource(o.devices.resources())
	}
	cmgr = &sizedContainerManager{ContainerManager: cmgr, disk: mach.disk}
	hk := kubemark.NewHollowKubelet(f, c, client, heartbeat,
		mach, images, rt, cmgr)
	hk.KubeletDeps.ProbeManager = probes{}
	mounter := mount.New("")
	hk.KubeletDeps.Mounter = mounter
	hk.KubeletDeps.HostUtil = hostutil.NewHostUtil()
	hk.KubeletDeps.Subpather = subpath.New(mounter)

	klog.InfoS("starting hollow kubelet", "node", o.nodeName, "rootDir", root)
	go hk.Run(ctx) // blocks forever once the kubelet runs
	<-ctx.Done()
	klog.InfoS("hollow kubelet stopping", "node", o.nodeName)
	return nil
}

func newMachine(o options) (*machine, error) {
	m := &machine{Fake: &cadvisortest.Fake{NodeName: o.nodeName}, cores: o.cores}
	for _, q := range []struct {
		flag, v string
		to      *uint64
	}{{"memory", o.memory, &m.memory}, {"ephemeral-storage", o.disk, &m.disk}} {
		if q.v == "" {
			continue
		}
		v, err := resource.ParseQuantity(q.v)
		if err != nil || v.Sign() < 0 {
			return nil, fmt.Errorf("--%s=%s: want a non-negative quantity", q.flag, q.v)
		}
		*q.to = uint64(v.Value())
	}
	return m, nil
}
