// Package simguest runs a guest cluster (the RKE2 side) for the lab and the
// end-to-end tests: a real etcd and kube-apiserver, the real kube-controller-manager with the controllers a
// volume's life goes through, the real kube-scheduler, the real
// csi-provisioner, csi-attacher and csi-resizer with the chart's flags, the driver's
// controller process, and per guest node the real kubelet (hollow-kubelet),
// a plugin registrar and the driver's node-plugin process. Every component is
// its own OS process (package proc).
package simguest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/proc"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest/chart"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest/nodetap"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// Controllers are the kube-controller-manager controllers the lab runs: what
// a volume's life goes through (attach/detach, binder, protection), what
// makes the workload (CronJob, Job, StatefulSet, ReplicaSet, garbage
// collection), and what keeps nodes and namespaces honest.
var Controllers = []string{
	"persistentvolume-attach-detach-controller",
	"persistentvolume-binder-controller",
	"persistentvolume-protection-controller",
	"persistentvolumeclaim-protection-controller",
	"persistentvolume-expander-controller",
	"cronjob-controller",
	"job-controller",
	"statefulset-controller",
	"replicaset-controller",
	"garbage-collector-controller",
	"node-lifecycle-controller",
	"taint-eviction-controller",
	"pod-garbage-collector-controller",
	"namespace-controller",
	"serviceaccount-controller",
}

// Options configure the guest cluster.
type Options struct {
	// Dir holds the guest control plane's state.
	Dir string
	// SocketDir is a short directory for sockets and kubelet roots (unix
	// socket paths are limited to 107 bytes).
	SocketDir string
	// LogDir receives every component's log.
	LogDir string
	// Bin is the directory of the upstream binaries (hack/tools.sh).
	Bin string
	// DriverBinary is the driver's node plugin (and, unless
	// ControllerBinary, controller) binary.
	DriverBinary string
	// ControllerBinary replaces the driver's controller process (a binary
	// taking upstream's flags: --endpoint --nodeid --kubeconfig
	// --host-storage-class).
	ControllerBinary string
	// AgentBinary runs the workload's containers (image AgentImage).
	AgentBinary []string
	AgentImage  string
	// AgentEnv is added to the kubelets' environment, which the agent
	// processes inherit.
	AgentEnv []string
	// Manifests are the chart's rendered objects and flags.
	Manifests *chart.Manifests
	// Host is the simulated Harvester.
	Host *simhost.Host
	// NodeStatusUpdate is the kubelets' node status period (volumesInUse
	// goes out with it).
	NodeStatusUpdate time.Duration
	// KubeletSyncFrequency is the kubelets' pod sync period.
	KubeletSyncFrequency time.Duration
	// ContainerRestartDelay is how long an exited driver or sidecar process
	// waits before it is started again, as the kubelet restarts containers
	// (default 1s).
	ContainerRestartDelay time.Duration
	// Verbosity of the guest components' logs.
	Verbosity int
	// SkipUnstage is the probability that a node's tap answers
	// NodeUnstageVolume without passing it to the driver, as a kubelet that
	// skips the unstage leaves the disk mounted.
	SkipUnstage float64
	// Seed seeds the taps' decisions.
	Seed uint64
	// OnNodeCall is told about every node call the kubelets make.
	OnNodeCall func(nodetap.Call)
	// InCluster gives the driver processes what a pod has: the guest API
	// server in KUBERNETES_SERVICE_HOST/PORT and credentials mounted at
	// /var/run/secrets/kubernetes.io/serviceaccount. Upstream's driver
	// needs them. The mount is only safe in a private mount namespace
	// (hcsi-lab runs in one).
	InCluster bool
}

// Guest is a running guest cluster.
type Guest struct {
	Env   *testenv.Env
	Kube  kubernetes.Interface
	Procs *proc.Group

	o              Options
	hostKubeconfig string
	ctx            context.Context
	cancel         context.CancelFunc

	saMounted   bool
	createdDirs []string // deepest first

	mu         sync.Mutex
	controller *proc.Proc
	nodes      map[string]*Node
}

// Node is one guest node's processes.
type Node struct {
	Name    string
	Root    string // kubelet root directory
	Socket  string // the driver's node-plugin socket
	TapSock string // what the kubelet calls: the lab's tap in front of Socket
	Tap     *nodetap.Tap
	Kubelet *proc.Proc
	Plugin  *proc.Proc
	Reg     *proc.Proc
}

// ControllerSocket is where the driver's controller process serves CSI.
func (g *Guest) ControllerSocket() string {
	return filepath.Join(g.o.SocketDir, "controller", "csi.sock")
}

// Start starts the guest control plane, the CSI objects of the chart, the
// sidecars and the driver's controller process.
func Start(ctx context.Context, o Options) (*Guest, error) {
	if o.NodeStatusUpdate == 0 {
		o.NodeStatusUpdate = 10 * time.Second
	}
	if o.KubeletSyncFrequency == 0 {
		o.KubeletSyncFrequency = 10 * time.Second
	}
	if o.Verbosity == 0 {
		o.Verbosity = 2
	}
	if o.ContainerRestartDelay == 0 {
		o.ContainerRestartDelay = time.Second
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	g := &Guest{o: o, ctx: runCtx, cancel: cancel, nodes: map[string]*Node{}}
	if err := os.MkdirAll(filepath.Join(o.Dir, "control-plane"), 0o750); err != nil {
		cancel()
		return nil, err
	}
	env, err := testenv.Start(ctx, testenv.Options{Dir: filepath.Join(o.Dir, "control-plane")})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("guest control plane: %w", err)
	}
	g.Env = env
	if g.Kube, err = kubernetes.NewForConfig(env.Config); err != nil {
		g.Stop(ctx)
		return nil, err
	}
	if g.Procs, err = proc.NewGroup(ctx, o.LogDir); err != nil {
		g.Stop(ctx)
		return nil, err
	}
	if err := g.start(ctx); err != nil {
		g.Stop(ctx)
		return nil, err
	}
	return g, nil
}

func (g *Guest) bin(name string) string { return filepath.Join(g.o.Bin, name) }

func (g *Guest) start(ctx context.Context) error {
	o := g.o
	if err := g.applyCSIObjects(ctx); err != nil {
		return err
	}
	kc := g.Env.Kubeconfig
	v := fmt.Sprintf("--v=%d", o.Verbosity)
	if _, err := g.Procs.Start(proc.Spec{Name: "kube-controller-manager", Path: g.bin("kube-controller-manager"), Args: []string{
		"--kubeconfig=" + kc,
		"--controllers=" + strings.Join(Controllers, ","),
		"--use-service-account-credentials=false",
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=0",
		v,
	}}); err != nil {
		return err
	}
	if _, err := g.Procs.Start(proc.Spec{Name: "kube-scheduler", Path: g.bin("kube-scheduler"), Args: []string{
		"--kubeconfig=" + kc,
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=0",
		v,
	}}); err != nil {
		return err
	}

	if o.InCluster {
		if err := g.mountServiceAccount(); err != nil {
			return fmt.Errorf("in-cluster credentials: %w", err)
		}
	}
	g.hostKubeconfig = filepath.Join(o.SocketDir, "host-kubeconfig")
	if err := o.Host.WriteDriverKubeconfig(g.ctx, g.hostKubeconfig); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(g.ControllerSocket()), 0o750); err != nil {
		return err
	}
	if err := g.startController(); err != nil {
		return err
	}
	ns := o.Manifests.Namespace
	vars := map[string]string{"ADDRESS": g.ControllerSocket(), "POD_NAMESPACE": ns}
	// The snapshotter is not run: without the VolumeSnapshot CRDs and the
	// snapshot controller (neither in the lab) it has nothing to act on.
	for _, sc := range []string{"csi-provisioner", "csi-attacher", "csi-resizer"} {
		args, err := chart.Args(o.Manifests.Controller, sc, vars)
		if err != nil {
			return err
		}
		if args, err = chart.Rewrite(args, map[string]string{"http-endpoint": "", "v": fmt.Sprint(o.Verbosity)}, "--kubeconfig="+kc); err != nil {
			return err
		}
		// A sidecar exits when it loses the driver's socket (the controller
		// process restarting); the kubelet restarts it, so does the lab.
		if _, err := g.Procs.Start(proc.Spec{Name: sc, Path: g.bin(sc), Args: args, Restart: true, RestartDelay: o.ContainerRestartDelay}); err != nil {
			return err
		}
	}
	return nil
}

// applyCSIObjects creates the chart's CSIDriver and StorageClass.
func (g *Guest) applyCSIObjects(ctx context.Context) error {
	d := g.o.Manifests.CSIDriver.DeepCopy()
	if _, err := g.Kube.StorageV1().CSIDrivers().Create(ctx, d, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("CSIDriver: %w", err)
	}
	sc := g.o.Manifests.StorageClass.DeepCopy()
	if _, err := g.Kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("StorageClass: %w", err)
	}
	if _, err := g.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: g.o.Manifests.Namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// StorageClass is the chart's StorageClass name.
func (g *Guest) StorageClass() *storagev1.StorageClass { return g.o.Manifests.StorageClass }

// controllerArgs are the chart's driver arguments for the controller
// process, pointed at the lab's socket and host kubeconfig; for a
// --controller-binary, upstream's four flags.
func (g *Guest) controllerArgs() ([]string, string, error) {
	sock := "unix://" + g.ControllerSocket()
	if g.o.ControllerBinary != "" {
		return []string{
			"--endpoint=" + sock,
			"--nodeid=lab-controller",
			"--kubeconfig=" + g.hostKubeconfig,
			"--host-storage-class=" + g.o.Host.StorageClass(),
		}, g.o.ControllerBinary, nil
	}
	args, err := chart.Args(g.o.Manifests.Controller, "harvester-csi-driver", nil)
	if err != nil {
		return nil, "", err
	}
	metrics, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	args, err = chart.Rewrite(args, map[string]string{
		"endpoint":        sock,
		"kubeconfig":      g.hostKubeconfig,
		"metrics-address": metrics,
	}, "--v=4")
	return args, g.o.DriverBinary, err
}

func (g *Guest) startController() error {
	args, bin, err := g.controllerArgs()
	if err != nil {
		return err
	}
	p, err := g.Procs.Start(proc.Spec{Name: "driver-controller", Path: bin, Args: args, Env: g.podEnv(), Restart: true, RestartDelay: g.o.ContainerRestartDelay})
	if err != nil {
		return err
	}
	g.mu.Lock()
	g.controller = p
	g.mu.Unlock()
	return nil
}

// Controller is the driver's controller process.
func (g *Guest) Controller() *proc.Proc {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.controller
}

// AddNode starts guest node name: its kubelet, the driver's node plugin and
// the registrar that registers the plugin with the kubelet. The VM of the
// same name must exist on the host.
func (g *Guest) AddNode(ctx context.Context, name string) (*Node, error) {
	o := g.o
	dir := filepath.Join(o.SocketDir, name)
	n := &Node{Name: name, Root: filepath.Join(dir, "kubelet"), Socket: filepath.Join(dir, "csi", "csi.sock"),
		TapSock: filepath.Join(dir, "tap.sock")}
	for _, d := range []string{n.Root, filepath.Dir(n.Socket), filepath.Join(n.Root, "plugins_registry")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	args, err := chart.Args(o.Manifests.Node, "harvester-csi-driver", nil)
	if err != nil {
		return nil, err
	}
	metrics, err := freeAddr()
	if err != nil {
		return nil, err
	}
	args, err = chart.Rewrite(args, map[string]string{
		"endpoint":        "unix://" + n.Socket,
		"kubeconfig":      g.hostKubeconfig,
		"by-id-dir":       o.Host.ByIDDir(name),
		"metrics-address": metrics,
		// The stale staging sweeper only touches this kubelet's mounts.
		"kubelet-root-dir": n.Root,
	}, "--nodeid="+name, "--v=4")
	if err != nil {
		return nil, err
	}
	if n.Plugin, err = g.Procs.Start(proc.Spec{Name: "driver-node-" + name, Path: o.DriverBinary, Args: args,
		Env: append(g.podEnv(), "NODE_NAME="+name), Restart: true, RestartDelay: o.ContainerRestartDelay}); err != nil {
		return nil, err
	}
	seed := o.Seed
	for _, c := range name {
		seed = seed*31 + uint64(c)
	}
	if n.Tap, err = nodetap.Start(ctx, nodetap.Options{Node: name, Listen: n.TapSock, Plugin: n.Socket,
		SkipUnstage: o.SkipUnstage, Seed: seed, OnCall: o.OnNodeCall}); err != nil {
		return nil, err
	}
	if n.Reg, err = g.Procs.Start(proc.Spec{Name: "registrar-" + name, Path: g.bin("csi-registrar"), Args: []string{
		"--csi-address=" + n.Socket,
		"--kubelet-registration-path=" + n.TapSock,
		"--plugin-registration-dir=" + filepath.Join(n.Root, "plugins_registry"),
	}}); err != nil {
		return nil, err
	}
	kargs := []string{
		"--kubeconfig=" + g.Env.Kubeconfig,
		"--node-name=" + name,
		"--root-dir=" + n.Root,
		"--node-status-update-frequency=" + o.NodeStatusUpdate.String(),
		"--sync-frequency=" + o.KubeletSyncFrequency.String(),
		fmt.Sprintf("--v=%d", o.Verbosity),
	}
	if len(o.AgentBinary) > 0 {
		kargs = append(kargs, "--exec="+o.AgentImage+"="+strings.Join(o.AgentBinary, " "))
	}
	if n.Kubelet, err = g.Procs.Start(proc.Spec{Name: "kubelet-" + name, Path: g.bin("hollow-kubelet"), Args: kargs, Env: o.AgentEnv}); err != nil {
		return nil, err
	}
	g.mu.Lock()
	g.nodes[name] = n
	g.mu.Unlock()
	return n, nil
}

// Nodes lists the guest nodes.
func (g *Guest) Nodes() []*Node {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []*Node
	for _, n := range g.nodes {
		out = append(out, n)
	}
	return out
}

// WaitNodesReady waits until every named node is Ready and its CSINode lists
// the driver (the registration went through the kubelet's plugin registry).
func (g *Guest) WaitNodesReady(ctx context.Context, names []string) error {
	driver := g.o.Manifests.CSIDriver.Name
	var last string
	err := wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if err := g.Procs.Dead(); err != nil {
			return false, err
		}
		for _, name := range names {
			node, err := g.Kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				last = fmt.Sprintf("node %s: %v", name, err)
				return false, nil
			}
			ready := false
			for _, c := range node.Status.Conditions {
				ready = ready || (c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue)
			}
			if !ready {
				last = fmt.Sprintf("node %s not Ready", name)
				return false, nil
			}
			cn, err := g.Kube.StorageV1().CSINodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				last = fmt.Sprintf("CSINode %s: %v", name, err)
				return false, nil
			}
			found := false
			for _, d := range cn.Spec.Drivers {
				found = found || (d.Name == driver && d.NodeID == name)
			}
			if !found {
				last = fmt.Sprintf("CSINode %s does not list %s with node ID %s yet", name, driver, name)
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("guest nodes not ready (%s): %w", last, err)
	}
	return nil
}

// Stop stops every process, keeps the control plane's logs and stops it.
func (g *Guest) Stop(ctx context.Context) error {
	var errs []error
	if g.Procs != nil {
		g.Procs.Stop(15 * time.Second)
	}
	for _, n := range g.Nodes() {
		if n.Tap != nil {
			n.Tap.Stop()
		}
	}
	g.cancel()
	if g.saMounted {
		errs = append(errs, unix.Unmount(serviceAccountDir, unix.MNT_DETACH))
	}
	for _, d := range g.createdDirs {
		_ = os.Remove(d) // only if empty: never another's
	}
	if g.Env != nil {
		if g.o.LogDir != "" {
			errs = append(errs, simhost.CopyLogs(g.Env.Dir, g.o.LogDir, "guest-"))
		}
		g.Env.Stop()
	}
	klog.FromContext(ctx).V(2).Info("guest stopped")
	return errors.Join(errs...)
}

// serviceAccountDir is where in-cluster clients read their credentials.
const serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// mountServiceAccount mounts a tmpfs with the guest's admin token and CA at
// serviceAccountDir (in the lab's private mount namespace).
func (g *Guest) mountServiceAccount() error {
	// Remember which directories are new, to remove them at Stop.
	for d := serviceAccountDir; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil {
			break
		}
		g.createdDirs = append(g.createdDirs, d)
	}
	if err := os.MkdirAll(serviceAccountDir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", serviceAccountDir, "tmpfs", 0, "size=1m,mode=0755"); err != nil {
		return err
	}
	g.saMounted = true
	ca, err := os.ReadFile(filepath.Join(g.Env.Dir, "certs", "apiserver.crt"))
	if err != nil {
		return err
	}
	for name, data := range map[string][]byte{
		"token":     []byte(g.Env.Config.BearerToken),
		"ca.crt":    ca,
		"namespace": []byte(g.o.Manifests.Namespace),
	} {
		if err := os.WriteFile(filepath.Join(serviceAccountDir, name), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// podEnv is the environment a pod's container gets from the kubelet.
func (g *Guest) podEnv() []string {
	if !g.o.InCluster {
		return nil
	}
	u, err := url.Parse(g.Env.Config.Host)
	if err != nil {
		return nil
	}
	return []string{"KUBERNETES_SERVICE_HOST=" + u.Hostname(), "KUBERNETES_SERVICE_PORT=" + u.Port()}
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
