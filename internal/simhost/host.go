// Package host runs the lab's Harvester side: a real etcd and kube-apiserver
// (internal/testenv), the KubeVirt simulator (internal/kubevirtsim) with
// loop-device disks (internal/loopdisk), and one VM with its VMI per guest
// node.
package simhost

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// Options configure the host.
type Options struct {
	// Dir holds the host's state: control plane, backing files, by-id
	// directories.
	Dir string
	// LogDir receives the control plane's logs when the host stops.
	LogDir string
	// Namespace holds the guest VMs (default "guests").
	Namespace string
	// Sim are the simulator options (Namespace, DiskHook are set here).
	Sim kubevirtsim.Options
}

// Host is a running simulated Harvester cluster.
type Host struct {
	Env       *testenv.Env
	Sim       *kubevirtsim.Sim
	Disks     *loopdisk.LoopDisks
	Kube      kubernetes.Interface
	Namespace string

	o      Options
	cancel context.CancelFunc
}

// Start starts the host cluster.
func Start(ctx context.Context, o Options) (*Host, error) {
	if o.Namespace == "" {
		o.Namespace = "guests"
	}
	h := &Host{Namespace: o.Namespace, o: o}
	if err := os.MkdirAll(filepath.Join(o.Dir, "control-plane"), 0o750); err != nil {

		return nil, err
	}
	env, err := testenv.Start(ctx, testenv.Options{Dir: filepath.Join(o.Dir, "control-plane")})
	if err != nil {
		return nil, fmt.Errorf("host control plane: %w", err)
	}
	h.Env = env
	h.Kube, err = kubernetes.NewForConfig(env.Config)
	if err != nil {
		h.Stop(ctx)
		return nil, err
	}
	if _, err := h.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: o.Namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		h.Stop(ctx)
		return nil, err
	}
	h.Disks, err = loopdisk.New(loopdisk.Options{
		BackingDir: filepath.Join(o.Dir, "backing"),
		ByIDRoot:   filepath.Join(o.Dir, "by-id"),
		Size: func(ctx context.Context, claim string) (int64, error) {
			pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				return 0, err
			}
			q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
			return q.Value(), nil
		},
	})
	if err != nil {
		h.Stop(ctx)
		return nil, err
	}
	so := o.Sim
	so.Namespace = o.Namespace
	so.DiskHook = hardUnplug{h.Disks}
	// The driver leaves the host class to Harvester's default when the guest
	// StorageClass names none (the chart's does not).
	so.BindClasslessPVCs = true
	h.Sim, err = kubevirtsim.New(env.Config, so)
	if err != nil {
		h.Stop(ctx)
		return nil, err
	}
	simCtx, cancel := context.WithCancel(klog.NewContext(context.WithoutCancel(ctx), klog.FromContext(ctx)))
	h.cancel = cancel
	if err := h.Sim.Start(simCtx); err != nil {
		h.Sim = nil
		h.Stop(ctx)
		return nil, fmt.Errorf("simulator: %w", err)
	}
	// Harvester's class is its default: the API server's DefaultStorageClass
	// admission gives it to the classless PVCs the driver creates, which the
	// PersistentVolumeClaimResize admission needs before it lets one grow.
	if err := h.markDefaultClass(ctx); err != nil {
		h.Stop(ctx)
		return nil, fmt.Errorf("default storage class: %w", err)
	}
	if err := h.onlineExpansionSetting(ctx); err != nil {
		h.Stop(ctx)
		return nil, fmt.Errorf("harvester setting %s: %w", onlineExpandSetting, err)
	}
	if err := h.growDisks(simCtx); err != nil {
		h.Stop(ctx)
		return nil, fmt.Errorf("disk growth: %w", err)
	}
	return h, nil
}

// onlineExpandSetting is the Harvester setting (1.4 and later) upstream's
// driver reads before it grows a volume in use; it refuses the expansion
// when the setting cannot be read.
const onlineExpandSetting = "csi-online-expand-validation"

func (h *Host) onlineExpansionSetting(ctx context.Context) error {
	dyn, err := dynamic.NewForConfig(h.Env.Config)
	if err != nil {
		return err
	}
	res := dyn.Resource(schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"})
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "harvesterhci.io/v1beta1", "kind": "Setting",
		"metadata": map[string]any{"name": onlineExpandSetting},
		"default":  "true",
	}}
	// The simulator installs the Setting CRD as it starts; it may not be
	// served yet.
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := res.Create(ctx, obj, metav1.CreateOptions{})
		return err == nil || apierrors.IsAlreadyExists(err), nil
	})
}

func (h *Host) markDefaultClass(ctx context.Context) error {
	patch := []byte(`{"metadata":{"annotations":{"storageclass.kubernetes.io/is-default-class":"true"}}}`)
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := h.Kube.StorageV1().StorageClasses().Patch(ctx, h.StorageClass(), types.MergePatchType, patch, metav1.PatchOptions{})
		return err == nil, nil // the simulator creates the class as it starts
	})
}

// growDisks plays Longhorn's online expansion below the simulator: once a
// host PVC's capacity grew (the simulator answers the driver's expansion),
// its backing file grows and every loop device on it sees the new size, as
// the guest's disk does when Longhorn expands an attached volume. A disk not
// plugged yet gets the claim's size when it is plugged.
func (h *Host) growDisks(ctx context.Context) error {
	f := informers.NewSharedInformerFactoryWithOptions(h.Kube, 0, informers.WithNamespace(h.Namespace))
	inf := f.Core().V1().PersistentVolumeClaims().Informer()
	grow := func(obj any) {
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		want := pvc.Status.Capacity[corev1.ResourceStorage]
		st, err := os.Stat(h.Disks.BackingFile(pvc.Name))
		if err != nil || want.Value() <= st.Size() {
			return
		}
		if err := h.Disks.Grow(ctx, pvc.Name, want.Value()); err != nil {
			klog.FromContext(ctx).Error(err, "growing the disk of an expanded host PVC", "pvc", pvc.Name, "bytes", want.Value())
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    grow,
		UpdateFunc: func(_, obj any) { grow(obj) },
	}); err != nil {
		return err
	}
	f.Start(ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("%v cache not synced", typ)
		}
	}
	return nil
}

// hardUnplug is the loop-device disk hook with one change that keeps the
// lab honest: an unplugged disk stops answering at once, as a disk removed
// from a VM does. A plain loop device detached while the guest still has it
// mounted (a staging mount whose NodeUnstageVolume never came) stays fully
// usable until the last unmount, so the stale filesystem would write its
// cached state over the data another node wrote since; with a real hot
// unplug those writes fail. So before the device is detached its size limit
// drops to one sector: every later read or write of the filesystem fails
// with an I/O error and nothing reaches the backing file.
type hardUnplug struct{ *loopdisk.LoopDisks }

func (d hardUnplug) Unplug(ctx context.Context, vm, volume string) error {
	if dev, ok := d.Device(vm, volume); ok {
		if err := cutIO(dev); err != nil {
			klog.FromContext(ctx).Error(err, "cannot cut the unplugged disk's I/O", "vm", vm, "volume", volume, "device", dev)
		}
	}
	return d.LoopDisks.Unplug(ctx, vm, volume)
}

func cutIO(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return fmt.Errorf("LOOP_GET_STATUS64 %s: %w", dev, err)
	}
	info.Sizelimit = 512
	if err := unix.IoctlLoopSetStatus64(int(f.Fd()), info); err != nil {
		return fmt.Errorf("LOOP_SET_STATUS64 %s: %w", dev, err)
	}
	return nil
}

// CreateVM creates the running VM of guest node name.
func (h *Host) CreateVM(ctx context.Context, name string) error {
	_, err := h.Sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: h.Namespace, Name: name})
	return err
}

// ByIDDir is the by-id directory the node plugin of VM name reads.
func (h *Host) ByIDDir(name string) string { return h.Disks.ByIDDir(h.Namespace + "/" + name) }

// WriteDriverKubeconfig writes the kubeconfig a driver process uses to reach
// the host (TLS front of the simulator's proxy, admin token, VM namespace);
// it works until ctx is done.
func (h *Host) WriteDriverKubeconfig(ctx context.Context, path string) error {
	return h.Sim.WriteKubeconfig(ctx, path, h.Namespace)
}

// Stop stops the simulator, unplugs every disk, keeps the control plane's
// logs in LogDir and stops the control plane.
func (h *Host) Stop(ctx context.Context) error {
	var errs []error
	if h.cancel != nil {
		h.cancel()
	}
	if h.Sim != nil {
		h.Sim.Stop()
	}
	if h.Disks != nil {
		errs = append(errs, h.Disks.Close(context.WithoutCancel(ctx)))
	}
	if h.Env != nil {
		if h.o.LogDir != "" {
			errs = append(errs, CopyLogs(h.Env.Dir, h.o.LogDir, "host-"))
		}
		h.Env.Stop()
	}
	return errors.Join(errs...)
}

// CopyLogs copies dir's *.log files to logDir, names prefixed.
func CopyLogs(dir, logDir, prefix string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(logDir, 0o750); err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".log") {
			continue
		}
		errs = append(errs, copyFile(filepath.Join(dir, e.Name()), filepath.Join(logDir, prefix+e.Name())))
	}
	return errors.Join(errs...)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// StorageClass is the host storage class the simulated provisioner binds.
func (h *Host) StorageClass() string {
	if h.o.Sim.StorageClass != "" {
		return h.o.Sim.StorageClass
	}
	return kubevirtsim.DefaultStorageClass
}
