package simhost

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/proc"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
)

// DefaultHostNodes is the number of host nodes with HostStorage when
// Options.HostNodes is 0: a small Harvester cluster.
const DefaultHostNodes = 3

// HostControllers are the host kube-controller-manager's controllers: the
// attach/detach controller that turns a scheduled pod's Longhorn volumes
// into host VolumeAttachments; the node lifecycle controller, which lifts
// the not-ready taint a kubelet registers its node with and puts it back
// when the node stops reporting; and the publisher of kube-root-ca.crt,
// which every pod with a service-account token volume (KubeVirt's
// attachment pods have one) needs before its kubelet mounts it.
var HostControllers = []string{
	"persistentvolume-attach-detach-controller",
	"node-lifecycle-controller",
	"root-ca-certificate-publisher-controller",
}

// KubeVirt's node resources: virt-handler's device plugins advertise each
// with --max-devices, 1000 by default (kubevirt v1.7.0
// cmd/virt-handler/virt-handler.go:105), and virt-launcher pods request
// them (pkg/virt-controller/services/template.go:79-81).
var kubevirtDevices = []string{"devices.kubevirt.io/kvm", "devices.kubevirt.io/tun", "devices.kubevirt.io/vhost-net"}

// hostNodeLabels are what virt-handler's node labeller writes and
// virt-launcher pods select on (kubevirt v1.7.0
// pkg/virt-controller/services/nodeselectorrenderer.go): schedulable for
// VMs, and the q35 machine type the VMI webhook defaults on amd64.
var hostNodeLabels = []string{"kubevirt.io/schedulable=true", "machine-type.node.kubevirt.io/q35=true"}

// A host node's machine: a modest Harvester server, so that the guest VMs
// of a lab fit on a few host nodes as they would on real ones, and with a
// disk, as virt-launcher pods request ephemeral storage (kubevirt v1.7.0
// pkg/virt-controller/services/template.go:906).
const (
	hostNodeCores  = "16"
	hostNodeMemory = "64Gi"
	hostNodeDisk   = "200Gi"
)

// containerScript runs KubeVirt's containers on a hollow host node: init
// containers (virt-launcher's copy of container-disk, a container disk's
// --no-op check) end at once; every other container (compute, the
// container disk, an attachment pod's hotplug-disk) runs until the kubelet
// stops it or, for a migrated virt-launcher, launcherExit ends it: either
// way SIGTERM, on which it exits 0 as virt-launcher does.
const containerScript = `#!/bin/sh
case "$1" in */cp) exit 0 ;; esac
for a in "$@"; do [ "$a" = "--no-op" ] && exit 0; done
trap 'exit 0' TERM
sleep infinity &
wait
`

// hostNodes are the host's nodes and Longhorn with Options.HostStorage.
type hostNodes struct {
	names []string
	procs *proc.Group
	// dir holds the sockets, the kubelet roots and the Longhorn devices'
	// files, and so the kubelets' mounts and loop devices: a short temporary
	// directory, as unix socket paths are limited to 107 bytes.
	dir string
	// devices carry Longhorn's device losses to virt-handler.
	devices *longhornDevices
}

// HostNodes names the host nodes (none without Options.HostStorage).
func (h *Host) HostNodes() []string {
	if h.nodes == nil {
		return nil
	}
	return slices.Clone(h.nodes.names)
}

func hostNodeNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("harvester-%d", i)
	}
	return names
}

// startHostStorage runs the host's storage path: Longhorn's objects and
// stand-in (controller and, per node, node plugin), the real scheduler,
// kube-controller-manager and csi-attacher, and per host node a real
// (hollow) kubelet with the plugin registered through the real registrar.
// It returns once every node is Ready with Longhorn's plugin registered.
func (h *Host) startHostStorage(ctx, runCtx context.Context) error {
	if err := simlonghorn.InstallCRDs(ctx, h.Env.Config); err != nil {
		return fmt.Errorf("Longhorn CRDs: %w", err)
	}
	lo := h.o.Longhorn
	if lo.Scale == 0 {
		lo.Scale = h.o.Sim.Scale
	}
	if lo.Scale == 0 {
		lo.Scale = 1
	}
	if _, err := h.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: longhornNamespace(lo)}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	dir, err := os.MkdirTemp("", "hh-")
	if err != nil {
		return err
	}
	h.nodes.dir = dir
	// The files behind the volumes' devices on the host nodes.
	lo.DeviceDir = filepath.Join(dir, "devices")
	h.nodes.devices = newLonghornDevices(h.Kube)
	lo.Devices = h.nodes.devices
	lh, err := simlonghorn.New(h.Env.Config, lo)
	if err != nil {
		return err
	}
	h.Longhorn = lh
	go lh.Run(runCtx)
	if err := h.longhornCSIDriver(ctx); err != nil {
		return err
	}
	logDir := filepath.Join(h.o.Dir, "logs")
	if h.o.LogDir != "" {
		logDir = filepath.Join(h.o.LogDir, "host-nodes")
	}
	if h.nodes.procs, err = proc.NewGroup(ctx, logDir); err != nil {
		return err
	}
	if err := h.startHostControlPlane(runCtx); err != nil {
		return err
	}
	script := filepath.Join(dir, "container.sh")
	if err := os.WriteFile(script, []byte(containerScript), 0o755); err != nil { //nolint:gosec // an executable script
		return err
	}
	for _, n := range h.nodes.names {
		if err := h.startHostNode(runCtx, n, script); err != nil {
			return fmt.Errorf("host node %s: %w", n, err)
		}
	}
	return h.waitHostNodes(ctx)
}

func longhornNamespace(o simlonghorn.Options) string {
	if o.Namespace == "" {
		return "longhorn-system"
	}
	return o.Namespace
}

// longhornCSIDriver is the CSIDriver Longhorn installs (longhorn-manager
// v1.10.1 deploy/install: attach required, pod info on mount).
func (h *Host) longhornCSIDriver(ctx context.Context) error {
	d := &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: simlonghorn.DriverName},
		Spec: storagev1.CSIDriverSpec{
			AttachRequired: ptr.To(true), PodInfoOnMount: ptr.To(true),
			VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
		},
	}
	if _, err := h.Kube.StorageV1().CSIDrivers().Create(ctx, d, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("CSIDriver %s: %w", d.Name, err)
	}
	return nil
}

func (h *Host) bin(name string) string { return filepath.Join(h.Env.Bin, name) }

// startHostControlPlane starts the scheduler, the controller manager, the
// Longhorn stand-in's controller service and the csi-attacher on it.
func (h *Host) startHostControlPlane(runCtx context.Context) error {
	kc := h.Env.Kubeconfig
	g := h.nodes.procs
	if _, err := g.Start(proc.Spec{Name: "host-kube-controller-manager", Path: h.bin("kube-controller-manager"), Args: []string{
		"--kubeconfig=" + kc,
		"--controllers=" + strings.Join(HostControllers, ","),
		"--root-ca-file=" + filepath.Join(h.Env.Dir, "certs", "apiserver.crt"),
		"--use-service-account-credentials=false",
		"--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0", "--v=2",
	}}); err != nil {
		return err
	}
	if _, err := g.Start(proc.Spec{Name: "host-kube-scheduler", Path: h.bin("kube-scheduler"), Args: []string{
		"--kubeconfig=" + kc, "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0", "--v=2",
	}}); err != nil {
		return err
	}
	sock := filepath.Join(h.nodes.dir, "longhorn-controller.sock")
	if err := h.serveLonghorn(runCtx, sock, ""); err != nil {
		return err
	}
	// Longhorn's own flags for its attacher (longhorn-manager v1.10.1
	// deploy: --timeout=2m5s, past ControllerPublish's 90 s wait).
	_, err := g.Start(proc.Spec{Name: "host-csi-attacher", Path: h.bin("csi-attacher"), Args: []string{
		"--csi-address=" + sock, "--kubeconfig=" + kc, "--leader-election=false", "--timeout=2m5s", "--v=2",
	}, Restart: true, RestartDelay: time.Second})
	return err
}

// serveLonghorn serves the stand-in's CSI services on sock until runCtx
// ends, and returns once the socket exists.
func (h *Host) serveLonghorn(runCtx context.Context, sock, node string) error {
	go func() {
		if err := h.Longhorn.Serve(runCtx, sock, node); err != nil && runCtx.Err() == nil {
			klog.FromContext(runCtx).Error(err, "Longhorn stand-in stopped serving", "socket", sock, "node", node)
		}
	}()
	return wait.PollUntilContextTimeout(runCtx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		_, err := os.Stat(sock)
		return err == nil, nil
	})
}

// startHostNode starts one host node: Longhorn's node plugin, the
// registrar that registers it with the kubelet, and the kubelet.
func (h *Host) startHostNode(runCtx context.Context, name, script string) error {
	root := filepath.Join(h.nodes.dir, name)
	registry := filepath.Join(root, "plugins_registry")
	sock := filepath.Join(root, "longhorn.sock")
	if err := os.MkdirAll(registry, 0o750); err != nil {
		return err
	}
	if err := h.serveLonghorn(runCtx, sock, name); err != nil {
		return err
	}
	g := h.nodes.procs
	if _, err := g.Start(proc.Spec{Name: "host-registrar-" + name, Path: h.bin("csi-registrar"), Args: []string{
		"--csi-address=" + sock, "--kubelet-registration-path=" + sock, "--plugin-registration-dir=" + registry,
	}}); err != nil {
		return err
	}
	args := []string{
		"--kubeconfig=" + h.Env.Kubeconfig,
		"--node-name=" + name,
		"--root-dir=" + root,
		"--node-labels=" + strings.Join(hostNodeLabels, ","),
		"--node-status-update-frequency=" + h.hostNodeStatusUpdate().String(),
		"--cores=" + hostNodeCores, "--memory=" + hostNodeMemory, "--ephemeral-storage=" + hostNodeDisk,
		"--v=2",
	}
	for _, d := range kubevirtDevices {
		args = append(args, "--device="+d+"=1000")
	}
	for _, img := range h.kubevirtImages() {
		args = append(args, "--exec="+img+"="+script)
	}
	_, err := g.Start(proc.Spec{Name: "host-kubelet-" + name, Path: h.bin("hollow-kubelet"), Args: args})
	return err
}

func (h *Host) hostNodeStatusUpdate() time.Duration {
	if h.o.HostNodeStatusUpdate > 0 {
		return h.o.HostNodeStatusUpdate
	}
	return 10 * time.Second // the kubelet's default
}

// kubevirtImages are the images KubeVirt's pods run: the launcher image
// virt-controller is given and the guest VMs' container disk (by digest).
func (h *Host) kubevirtImages() []string {
	if h.o.Real == "" {
		// The simulator's pods have no init containers that must end:
		// their containers run until deleted, as a hollow kubelet runs any
		// image it has no command for.
		return nil
	}
	return []string{"virt-launcher:" + h.o.Real, rootDiskImage}
}

// waitHostNodes waits until every host node is Ready with Longhorn's plugin
// in its CSINode.
func (h *Host) waitHostNodes(ctx context.Context) error {
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := h.nodes.procs.Dead(); err != nil {
			return false, err
		}
		for _, name := range h.nodes.names {
			if ok, why := h.hostNodeReady(ctx, name); !ok {
				last = why
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("host nodes not ready (%s): %w", last, err)
	}
	return nil
}

func (h *Host) hostNodeReady(ctx context.Context, name string) (bool, string) {
	node, err := h.Kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Sprintf("node %s: %v", name, err)
	}
	if !slices.ContainsFunc(node.Status.Conditions, func(c corev1.NodeCondition) bool {
		return c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue
	}) {
		return false, fmt.Sprintf("node %s not Ready", name)
	}
	if len(node.Spec.Taints) > 0 {
		return false, fmt.Sprintf("node %s still has taints %v", name, node.Spec.Taints)
	}
	cn, err := h.Kube.StorageV1().CSINodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Sprintf("CSINode %s: %v", name, err)
	}
	if !slices.ContainsFunc(cn.Spec.Drivers, func(d storagev1.CSINodeDriver) bool {
		return d.Name == simlonghorn.DriverName && d.NodeID == name
	}) {
		return false, fmt.Sprintf("CSINode %s does not list %s yet", name, simlonghorn.DriverName)
	}
	return true, ""
}

// stopHostNodes stops the host nodes' processes and then removes what their
// kubelets left on this machine: bind mounts under the kubelet roots and
// the loop devices the kubelets hold on published block targets.
func (h *Host) stopHostNodes(ctx context.Context) error {
	if h.nodes == nil {
		return nil
	}
	if h.nodes.procs != nil {
		h.nodes.procs.Stop(15 * time.Second)
	}
	if h.nodes.dir == "" {
		return nil
	}
	if err := errors.Join(unmountUnder(h.nodes.dir), detachLoopsUnder(ctx, h.nodes.dir)); err != nil {
		// Never remove a tree that may still have something mounted.
		return err
	}
	return os.RemoveAll(h.nodes.dir)
}

func unmountUnder(dir string) error {
	mounts, err := mountinfo.Read("")
	if err != nil {
		return err
	}
	var under []string
	for _, m := range mounts {
		if m.MountPoint == dir || strings.HasPrefix(m.MountPoint, dir+"/") {
			under = append(under, m.MountPoint)
		}
	}
	// Deepest first; a path mounted twice is unmounted twice.
	slices.SortFunc(under, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, p := range under {
		if out, err := exec.Command("umount", "-l", p).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("umount %s: %w: %s", p, err, out))
		}
	}
	return errors.Join(errs...)
}

func detachLoopsUnder(ctx context.Context, dir string) error {
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		backing := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), " (deleted)")
		if !strings.HasPrefix(backing, dir+"/") {
			continue
		}
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(f)))
		if out, err := exec.CommandContext(ctx, "losetup", "-d", dev).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("losetup -d %s (%s): %w: %s", dev, backing, err, out))
		}
	}
	return errors.Join(errs...)
}

// realKubeVirtNodes tells KubeVirt's control plane that real kubelets run
// the host nodes, so its kubelet stand-in stands aside.
func (h *Host) realKubeVirtNodes(ro *realkubevirt.Options) {
	if h.nodes == nil {
		return
	}
	ro.Kubelets = true
	ro.Nodes = h.nodes.names
	ro.Launchers = launcherExit{}
}

// launcherExit ends a virt-launcher pod's hollow containers as virt-launcher
// exits once its domain has migrated away: every process a host kubelet
// started for the pod carries the pod's UID (HCSI_POD_UID) and gets
// SIGTERM, on which containerScript exits 0.
type launcherExit struct{}

func (launcherExit) End(ctx context.Context, pod *corev1.Pod) error {
	want := []byte("\x00HCSI_POD_UID=" + string(pod.UID) + "\x00")
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return err
	}
	n := 0
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil || !bytes.Contains(append(append([]byte{0}, env...), 0), want) {
			continue
		}
		if err := syscall.Kill(pid, syscall.SIGTERM); err == nil {
			n++
		}
	}
	if n == 0 {
		return fmt.Errorf("no container process of pod %s/%s found", pod.Namespace, pod.Name)
	}
	klog.FromContext(ctx).V(2).Info("virt-launcher containers told to exit", "pod", klog.KObj(pod), "processes", n)
	return nil
}

// vmNameLabel is the label Harvester gives a VM's pods, naming the VM.
const vmNameLabel = "harvesterhci.io/vmName"

// place puts a guest VM on a host node: the one Options.Placement names,
// through a node selector, or else where the scheduler finds it best, kept
// apart from the other guest VMs by a preferred anti-affinity so that guest
// nodes spread over host nodes.
func (h *Host) place(spec *kubevirtv1.VirtualMachineInstanceSpec, vm string) {
	if h.nodes == nil {
		return
	}
	if node, ok := h.o.Placement[vm]; ok {
		spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
	}
	// A pinned VM keeps the term too: the scheduler weighs an existing
	// pod's preferred anti-affinity when it places the next one.
	spec.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{
		PreferredDuringSchedulingIgnoredDuringExecution: []corev1.WeightedPodAffinityTerm{{
			Weight: 100,
			PodAffinityTerm: corev1.PodAffinityTerm{
				TopologyKey: corev1.LabelHostname,
				LabelSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
					Key: vmNameLabel, Operator: metav1.LabelSelectorOpExists,
				}}},
			},
		}},
	}}
}

// HostNodeOf is the host node a guest VM's VMI runs on ("" when none yet).
func (h *Host) HostNodeOf(ctx context.Context, vm string) string {
	_, vmi := h.VM(ctx, vm)
	if vmi == nil {
		return ""
	}
	return vmi.Status.NodeName
}
