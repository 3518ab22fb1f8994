package simhost

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// Annotations the PV controller writes on a claim it bound
// (kubernetes v1.35.4 pkg/controller/volume/persistentvolume/util).
const (
	annBindCompleted     = "pv.kubernetes.io/bind-completed"
	annBoundByController = "pv.kubernetes.io/bound-by-controller"
)

// longhornProvisioner names the provisioner of Harvester's default class.
const longhornProvisioner = "driver.longhorn.io"

// createStorageClass creates Harvester's class on the real control plane,
// where no simulator installs it: expandable, bound at once.
func (h *Host) createStorageClass(ctx context.Context) error {
	sc := &storagev1.StorageClass{
		ObjectMeta:           metav1.ObjectMeta{Name: h.StorageClass()},
		Provisioner:          longhornProvisioner,
		ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
		AllowVolumeExpansion: ptr.To(true),
		VolumeBindingMode:    ptr.To(storagev1.VolumeBindingImmediate),
	}
	if _, err := h.Kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("storage class %s: %w", sc.Name, err)
	}
	return nil
}

// binder plays Longhorn's provisioner and kube-controller-manager's claim
// controllers for the guest namespace on the real control plane: it binds
// a claim of Harvester's class (and a classless one when asked) to a new
// PV, grows a bound claim's capacity to its request, and lets a deleted
// claim go once no pod uses it (no controller manager removes the
// protection finalizer here).
type binder struct {
	kube      kubernetes.Interface
	namespace string
	class     string
	classless bool
	// longhorn, when set, gets a Longhorn volume for each claim bound, as
	// Longhorn's CreateVolume makes one behind the PV it provisions.
	longhorn *simlonghorn.Sim

	pvcs  cache.Indexer
	pods  cache.Indexer
	queue workqueue.TypedRateLimitingInterface[string]
}

func (b *binder) run(ctx context.Context) error {
	b.queue = workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	f := informers.NewSharedInformerFactoryWithOptions(b.kube, 0, informers.WithNamespace(b.namespace))
	pvcInf := f.Core().V1().PersistentVolumeClaims().Informer()
	podInf := f.Core().V1().Pods().Informer()
	b.pvcs, b.pods = pvcInf.GetIndexer(), podInf.GetIndexer()
	add := func(obj any) {
		if k, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
			b.queue.Add(k)
		}
	}
	if _, err := pvcInf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: add, UpdateFunc: func(_, o any) { add(o) }}); err != nil {
		return err
	}
	// A pod going away may free a deleted claim.
	requeueAll := func(any) {
		for _, k := range b.pvcs.ListKeys() {
			b.queue.Add(k)
		}
	}
	if _, err := podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: requeueAll}); err != nil {
		return err
	}
	f.Start(ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("%v cache not synced", typ)
		}
	}
	go func() {
		<-ctx.Done()
		b.queue.ShutDown()
	}()
	go func() {
		for b.next(ctx) {
		}
	}()
	return nil
}

func (b *binder) next(ctx context.Context) bool {
	key, quit := b.queue.Get()
	if quit {
		return false
	}
	defer b.queue.Done(key)
	callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := b.sync(callCtx, key); err != nil && ctx.Err() == nil {
		if !apierrors.IsConflict(err) {
			klog.FromContext(ctx).V(2).Info("claim binder: retrying", "pvc", key, "err", err)
		}
		b.queue.AddRateLimited(key)
		return true
	}
	b.queue.Forget(key)
	return true
}

func (b *binder) sync(ctx context.Context, key string) error {
	obj, ok, err := b.pvcs.GetByKey(key)
	if err != nil || !ok {
		return err
	}
	pvc := obj.(*corev1.PersistentVolumeClaim)
	switch {
	case pvc.DeletionTimestamp != nil:
		return b.release(ctx, pvc)
	case !b.binds(pvc):
		return nil
	case pvc.Status.Phase == corev1.ClaimBound:
		return b.grow(ctx, pvc)
	case pvc.Status.Phase == corev1.ClaimPending || pvc.Status.Phase == "":
		return b.bind(ctx, pvc)
	}
	return nil
}

func (b *binder) binds(pvc *corev1.PersistentVolumeClaim) bool {
	if pvc.Spec.StorageClassName == nil {
		return b.classless
	}
	return *pvc.Spec.StorageClassName == b.class
}

func (b *binder) bind(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	size := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if size.IsZero() {
		size = resource.MustParse("1Gi")
	}
	modes := pvc.Spec.AccessModes
	if len(modes) == 0 {
		modes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
	}
	pvName := pvc.Spec.VolumeName
	if pvName == "" {
		pvName = "pvc-" + string(pvc.UID)
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": longhornProvisioner}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes: modes,
			ClaimRef: &corev1.ObjectReference{APIVersion: "v1", Kind: "PersistentVolumeClaim",
				Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              b.class,
			VolumeMode:                    pvc.Spec.VolumeMode,
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: longhornProvisioner, VolumeHandle: pvName,
			}},
		},
	}
	if err := b.longhornVolume(ctx, pvc, pvName, size.Value(), modes); err != nil {
		return fmt.Errorf("Longhorn volume %s: %w", pvName, err)
	}
	if _, err := b.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	claim := pvc.DeepCopy()
	if claim.Spec.VolumeName == "" || claim.Annotations[annBindCompleted] == "" {
		claim.Spec.VolumeName = pvName
		// The PV controller's marks of a finished bind: the scheduler's
		// volume binding takes a claim without them for unbound
		// (kubernetes v1.35.4 pkg/scheduler/framework/plugins/volumebinding).
		metav1.SetMetaDataAnnotation(&claim.ObjectMeta, annBindCompleted, "yes")
		metav1.SetMetaDataAnnotation(&claim.ObjectMeta, annBoundByController, "yes")
		var err error
		if claim, err = b.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	claim.Status.Phase = corev1.ClaimBound
	claim.Status.AccessModes = modes
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: size}
	_, err := b.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{})
	return err
}

// longhornVolume creates the Longhorn volume behind a claim's PV, named as
// the PV (Longhorn's CSI volume ID). Harvester's class is migratable, which
// Longhorn allows for block RWX volumes only (longhorn-manager v1.10.1
// csi/controller_server.go CreateVolume), so such a claim gets a
// migratable volume and any other an RWO one.
func (b *binder) longhornVolume(ctx context.Context, pvc *corev1.PersistentVolumeClaim, name string, size int64, modes []corev1.PersistentVolumeAccessMode) error {
	if b.longhorn == nil {
		return nil
	}
	return createLonghornVolume(ctx, b.longhorn, pvc, name, size, modes)
}

// createLonghornVolume is Longhorn's CreateVolume behind either control
// plane's provisioner (see binder.longhornVolume); a volume that exists
// already is the one a retried bind made.
func createLonghornVolume(ctx context.Context, lh *simlonghorn.Sim, pvc *corev1.PersistentVolumeClaim, name string, size int64, modes []corev1.PersistentVolumeAccessMode) error {
	if len(modes) == 0 {
		modes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
	}
	block := pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock
	err := lh.CreateVolume(ctx, simlonghorn.NewVolume{
		Name: name, Size: size, Migratable: block && slices.Contains(modes, corev1.ReadWriteMany),
		PVName: name, PVCNamespace: pvc.Namespace, PVCName: pvc.Name,
	})
	if apierrors.IsAlreadyExists(err) {
		return nil // a retry of a bind that failed later on
	}
	return err
}

// grow answers an expansion at once, as Longhorn grows an attached volume.
func (b *binder) grow(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	want := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	have := pvc.Status.Capacity[corev1.ResourceStorage]
	if want.Cmp(have) <= 0 {
		return nil
	}
	claim := pvc.DeepCopy()
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: want}
	_, err := b.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{})
	return err
}

// release drops the protection finalizer once no pod mounts the claim.
func (b *binder) release(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	const protection = "kubernetes.io/pvc-protection"
	if !slices.Contains(pvc.Finalizers, protection) {
		return nil
	}
	for _, obj := range b.pods.List() {
		pod := obj.(*corev1.Pod)
		if slices.ContainsFunc(pod.Spec.Volumes, func(v corev1.Volume) bool {
			return v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == pvc.Name
		}) {
			return nil // the pod's deletion requeues the claim
		}
	}
	claim := pvc.DeepCopy()
	claim.Finalizers = slices.DeleteFunc(claim.Finalizers, func(f string) bool { return f == protection })
	_, err := b.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Update(ctx, claim, metav1.UpdateOptions{})
	return err
}
