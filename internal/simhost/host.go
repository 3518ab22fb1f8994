// Package simhost assembles a simulated Harvester cluster, the one place the
// test suites (tests/framework) and the lab build it: a real etcd and
// kube-apiserver (internal/testenv), the KubeVirt simulator
// (internal/kubevirtsim) or KubeVirt's own control plane
// (internal/realkubevirt, Options.Real), a namespace for the guest cluster's VMs with one
// running VM and its VMI per guest node, and, when asked, loop-device disks
// (internal/loopdisk) that grow with their claims. What differs between its
// users is in Options.
package simhost

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/simharvester"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// DefaultNamespace holds the guest VMs when Options.Namespace is empty.
const DefaultNamespace = "guests"

// Options configure the host.
type Options struct {
	// Dir holds the host's state: control plane, backing files, by-id
	// directories. Empty: a temporary directory that Stop removes.
	Dir string
	// LogDir receives the control plane's logs when the host stops; empty:
	// they go with the control plane's directory.
	LogDir string
	// Namespace holds the guest VMs (default DefaultNamespace).
	Namespace string
	// Sim are the simulator's options; Namespace is set from the host's and,
	// with Disks, DiskHook is the host's loop disks. With Real, only Mode
	// (the KubeVirt CR's hotplug gates), StorageClass and BindClasslessPVCs
	// apply.
	Sim kubevirtsim.Options
	// Real, a KubeVirt tag built by hack/tools.sh (internal/realkubevirt),
	// runs KubeVirt's own virt-controller and virt-api in the simulator's
	// place; only the node agents are stand-ins. Host.Sim is nil then.
	Real string
	// RealRelease is the KubeVirt release whose virt-handler the node
	// agents play with Real (realkubevirt.Options.Release): a Harvester
	// release's own patch level on the nearest tag that builds; "" plays
	// the tag's.
	RealRelease string
	// VMs are the guest nodes whose running VMs (and VMIs) exist when Start
	// returns.
	VMs []string
	// Disks makes every hot-plugged volume a real loop device (root only):
	// one sparse file per host PVC sized from its request, grown when its
	// capacity grows, as Longhorn grows an attached volume.
	Disks bool
	// HardUnplug makes an unplugged disk stop answering at once, as a disk
	// removed from a VM does (see hardUnplug). Only with Disks.
	HardUnplug bool
	// Harvester sets up what an installed Harvester has and a driver process
	// relies on: the simulator's class is the default class, classless PVCs
	// bind, and the online-expansion setting exists.
	Harvester bool
	// Webhooks serves Harvester's admission webhooks of this release
	// (internal/simharvester; a profile's Webhooks) on the host's API
	// server, with either control plane; "" serves none.
	Webhooks simharvester.Release
	// WebhookCacheLag is simharvester.Options.CacheLag.
	WebhookCacheLag time.Duration
	// HostStorage runs the host storage path under each attachment pod
	// (hostnodes.go): HostNodes host nodes, each a real kubelet, with the
	// real kube-scheduler, attach/detach controller and csi-attacher, and
	// Longhorn's stand-in (internal/simlonghorn) behind every host claim,
	// on either control plane: KubeVirt's real one, or the simulator with
	// its kubelet standing aside (kubevirtsim.Options.Kubelets).
	HostStorage bool
	// HostNodes is the number of host nodes with HostStorage (default
	// DefaultHostNodes).
	HostNodes int
	// HostNodeStatusUpdate is the host kubelets' node status period, with
	// which volumesInUse goes out (default 10 s, the kubelet's).
	HostNodeStatusUpdate time.Duration
	// Longhorn are the stand-in's options with HostStorage; Scale defaults
	// to Sim.Scale.
	Longhorn simlonghorn.Options
	// Placement pins guest VMs to host nodes (VM name to host node name)
	// with HostStorage; the others are spread by the scheduler.
	Placement map[string]string
}

// Host is a running simulated Harvester cluster.
type Host struct {
	Env *testenv.Env
	// Sim is the simulator; nil with Options.Real.
	Sim *kubevirtsim.Sim
	// Real is KubeVirt's control plane with Options.Real, and KubeVirt
	// reaches it as the admin; both nil otherwise.
	Real     *realkubevirt.ControlPlane
	KubeVirt kubevirt.Interface
	// Disks are the loop disks (nil without Options.Disks).
	Disks *loopdisk.LoopDisks
	// Harvester are Harvester's webhooks with Options.Webhooks (nil
	// otherwise); Down and Up take their service away and back.
	Harvester *simharvester.Server
	// Longhorn is the Longhorn stand-in with Options.HostStorage, else nil.
	Longhorn  *simlonghorn.Sim
	Kube      kubernetes.Interface
	Namespace string

	o      Options
	nodes  *hostNodes // with Options.HostStorage
	tmp    string     // Dir when Start made it
	cancel context.CancelFunc
}

// Start starts the host cluster. ctx bounds the start only: the host runs
// until Stop, and the simulator logs to ctx's logger.
func Start(ctx context.Context, o Options) (*Host, error) {
	if o.Namespace == "" {
		o.Namespace = DefaultNamespace
	}
	if o.HardUnplug && !o.Disks {
		return nil, errors.New("simhost: HardUnplug needs Disks")
	}
	if o.RealRelease != "" && o.Real == "" {
		// The simulator's virt-handler follows Sim.Version; a release
		// named here would be silently ignored.
		return nil, errors.New("simhost: RealRelease needs Real (the simulator plays Sim.Version's virt-handler)")
	}
	if !o.HostStorage && (o.HostNodes != 0 || len(o.Placement) != 0) {
		return nil, errors.New("simhost: HostNodes and Placement need HostStorage")
	}
	h := &Host{Namespace: o.Namespace, o: o}
	if o.HostStorage {
		if o.HostNodes < 0 {
			return nil, fmt.Errorf("simhost: HostNodes %d is negative", o.HostNodes)
		}
		if o.HostNodes == 0 {
			o.HostNodes = DefaultHostNodes
		}
		h.nodes = &hostNodes{names: hostNodeNames(o.HostNodes)}
		for vm, node := range o.Placement {
			if !slices.Contains(h.nodes.names, node) {
				return nil, fmt.Errorf("simhost: Placement puts VM %s on %q, which is none of the host nodes %v", vm, node, h.nodes.names)
			}
		}
	}
	if err := h.start(ctx); err != nil {
		return nil, errors.Join(err, h.Stop(ctx))
	}
	return h, nil
}

func (h *Host) start(ctx context.Context) error {
	if h.o.Dir == "" {
		dir, err := os.MkdirTemp("", "hcsi-host-")
		if err != nil {
			return err
		}
		h.o.Dir, h.tmp = dir, dir
	}
	cp := filepath.Join(h.o.Dir, "control-plane")
	if err := os.MkdirAll(cp, 0o750); err != nil {
		return err
	}
	env, err := testenv.Start(ctx, h.envOptions(cp))
	if err != nil {
		return fmt.Errorf("host control plane: %w", err)
	}
	h.Env = env
	if h.Kube, err = kubernetes.NewForConfig(env.Config); err != nil {
		return err
	}
	if _, err := h.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: h.Namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("namespace %s: %w", h.Namespace, err)
	}
	runCtx, cancel := context.WithCancel(klog.NewContext(context.WithoutCancel(ctx), klog.FromContext(ctx)))
	h.cancel = cancel
	if h.o.Real != "" {
		if err := h.startReal(ctx, runCtx); err != nil {
			return err
		}
		return h.finishStart(ctx, runCtx)
	}
	so := h.o.Sim
	so.Namespace = h.Namespace
	if h.o.Disks {
		if so.DiskHook, err = h.newDisks(); err != nil {
			return err
		}
	}
	if h.o.Harvester {
		// The driver leaves the host class to Harvester's default when the
		// guest StorageClass names none (the chart's does not).
		so.BindClasslessPVCs = true
	}
	if h.nodes != nil {
		// Before the simulator: its first claim needs Longhorn.
		if err := h.startHostStorage(ctx, runCtx); err != nil {
			return fmt.Errorf("host storage: %w", err)
		}
		so.Kubelets = true
		so.ProvisionHook = func(ctx context.Context, pvc *corev1.PersistentVolumeClaim, pv string, size resource.Quantity) error {
			return createLonghornVolume(ctx, h.Longhorn, pvc, pv, size.Value(), pvc.Spec.AccessModes)
		}
	}
	if h.Sim, err = kubevirtsim.New(env.Config, so); err != nil {
		return err
	}
	if err := h.Sim.Start(runCtx); err != nil {
		h.Sim = nil
		return fmt.Errorf("simulator: %w", err)
	}
	if h.o.Harvester {
		if err := h.harvesterDefaults(ctx); err != nil {
			return err
		}
	}
	return h.finishStart(ctx, runCtx)
}

// finishStart is what follows either control plane: Longhorn's device
// losses passed on to it, disk growth and the guest VMs.
func (h *Host) finishStart(ctx, runCtx context.Context) error {
	h.passDeviceLosses()
	if h.o.Webhooks != "" {
		// Before the VMs, so that Harvester's mutator gives them its
		// termination grace period as on a real host.
		srv, err := simharvester.Start(ctx, h.Env.Config, simharvester.Options{Release: h.o.Webhooks, CacheLag: h.o.WebhookCacheLag})
		if err != nil {
			return fmt.Errorf("harvester webhooks: %w", err)
		}
		h.Harvester = srv
	}
	if h.o.Disks {
		if err := h.growDisks(runCtx); err != nil {
			return fmt.Errorf("disk growth: %w", err)
		}
	}
	if err := h.CreateVMs(ctx, h.o.VMs...); err != nil {
		return err
	}
	return nil
}

// CreateVMs creates the running VMs of these guest nodes, at once, and
// returns when their VMIs run.
func (h *Host) CreateVMs(ctx context.Context, names ...string) error {
	var wg sync.WaitGroup
	errs := make([]error, len(names))
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if h.Real != nil {
				if err := h.createRealVM(ctx, n); err != nil {
					errs[i] = fmt.Errorf("VM %s/%s: %w", h.Namespace, n, err)
				}
				return
			}
			var place kubevirtv1.VirtualMachineInstanceSpec
			h.place(&place, n)
			if _, err := h.Sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: h.Namespace, Name: n,
				NodeSelector: place.NodeSelector, Affinity: place.Affinity}); err != nil {
				errs[i] = fmt.Errorf("VM %s/%s: %w", h.Namespace, n, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// CreateVolumes creates n bound 1Gi host PVCs named prefix-00, prefix-01, ...
// and returns their names.
func (h *Host) CreateVolumes(ctx context.Context, prefix string, n int) ([]string, error) {
	names := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range names {
		names[i] = fmt.Sprintf("%s-%02d", prefix, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if h.Real != nil {
				if err := h.createRealPVC(ctx, names[i], "1Gi"); err != nil {
					errs[i] = fmt.Errorf("host PVC %s/%s: %w", h.Namespace, names[i], err)
				}
				return
			}
			if _, err := h.Sim.CreatePVC(ctx, h.Namespace, names[i], "1Gi", false); err != nil {
				errs[i] = fmt.Errorf("host PVC %s/%s: %w", h.Namespace, names[i], err)
			}
		}()
	}
	wg.Wait()
	return names, errors.Join(errs...)
}

// ByIDDir is the by-id directory the node plugin of VM name reads (needs
// Options.Disks).
func (h *Host) ByIDDir(name string) string { return h.Disks.ByIDDir(h.Namespace + "/" + name) }

// WriteDriverKubeconfig writes the kubeconfig a driver process uses to reach
// the host (TLS front of the simulator's proxy, admin token, VM namespace);
// it works until ctx is done.
func (h *Host) WriteDriverKubeconfig(ctx context.Context, path string) error {
	if h.Sim == nil {
		// The admin as well, straight to the API server.
		return testenv.WriteKubeconfig(path, h.Env.Config, h.Namespace)
	}
	return h.Sim.WriteKubeconfig(ctx, path, h.Namespace)
}

// StorageClass is the host storage class the simulated provisioner binds.
func (h *Host) StorageClass() string {
	if h.o.Sim.StorageClass != "" {
		return h.o.Sim.StorageClass
	}
	return kubevirtsim.DefaultStorageClass
}

// Stop stops the simulator, unplugs every disk, keeps the control plane's
// logs in LogDir and stops the control plane. It stops what a failed Start
// left running too.
func (h *Host) Stop(ctx context.Context) error {
	var errs []error
	if h.cancel != nil {
		h.cancel()
	}
	if h.Sim != nil {
		h.Sim.Stop()
	}
	if h.Real != nil {
		h.Real.Stop()
	}
	if h.Harvester != nil {
		h.Harvester.Stop()
	}
	errs = append(errs, h.stopHostNodes(ctx))
	if h.Disks != nil {
		errs = append(errs, h.Disks.Close(context.WithoutCancel(ctx)))
	}
	if h.Env != nil {
		if h.o.LogDir != "" {
			errs = append(errs, CopyLogs(h.Env.Dir, h.o.LogDir, "host-"))
		}
		h.Env.Stop()
	}
	// HCSI_KEEP_ENV keeps the control plane's directory (internal/testenv);
	// the host's lives around it.
	if h.tmp != "" && os.Getenv("HCSI_KEEP_ENV") == "" {
		errs = append(errs, os.RemoveAll(h.tmp))
	}
	return errors.Join(errs...)
}
