package simhost

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
)

// onlineExpandSetting is the Harvester setting (1.4 and later) upstream's
// driver reads before it grows a volume in use; it refuses the expansion
// when the setting cannot be read.
const onlineExpandSetting = "csi-online-expand-validation"

// harvesterDefaults makes Harvester's class the default: the API server's
// DefaultStorageClass admission gives it to the classless PVCs the driver
// creates, which the PersistentVolumeClaimResize admission needs before it
// lets one grow. And it writes the online-expansion setting.
func (h *Host) harvesterDefaults(ctx context.Context) error {
	if h.Sim == nil {
		if err := h.settingCRD(ctx); err != nil {
			return fmt.Errorf("harvester Setting CRD: %w", err)
		}
		// The simulator writes server-version itself; upstream's driver
		// refuses to start without it ("settings.harvesterhci.io
		// \"server-version\" not found").
		if err := h.setting(ctx, serverVersionSetting, map[string]any{"default": "", "value": h.serverVersion()}); err != nil {
			return fmt.Errorf("harvester setting %s: %w", serverVersionSetting, err)
		}
	}
	if err := h.markDefaultClass(ctx); err != nil {
		return fmt.Errorf("default storage class: %w", err)
	}
	if err := h.setting(ctx, onlineExpandSetting, map[string]any{"default": "true"}); err != nil {
		return fmt.Errorf("harvester setting %s: %w", onlineExpandSetting, err)
	}
	return nil
}

// serverVersionSetting is Harvester's own version, which upstream's driver
// reads as it starts.
const serverVersionSetting = "server-version"

// serverVersion is the Harvester release behind KubeVirt's real control
// plane: Sim.ServerVersion when set, else the release that ships the
// KubeVirt its node agents play (RealRelease, else the tag).
func (h *Host) serverVersion() string {
	if h.o.Sim.ServerVersion != "" {
		return h.o.Sim.ServerVersion
	}
	for _, v := range []string{h.o.RealRelease, h.o.Real} {
		if r := kubevirtsim.Version(v).HarvesterRelease(); r != "" {
			return r
		}
	}
	// Tags no Harvester ships: the release of their line.
	return map[string]string{"v1.6.0": "v1.7.0", "v1.8.4": "v1.9.0"}[h.o.Real]
}

// setting creates a Harvester Setting with fields beside its metadata,
// keeping one that exists.
func (h *Host) setting(ctx context.Context, name string, fields map[string]any) error {
	dyn, err := dynamic.NewForConfig(h.Env.Config)
	if err != nil {
		return err
	}
	res := dyn.Resource(schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"})
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "harvesterhci.io/v1beta1", "kind": "Setting",
		"metadata": map[string]any{"name": name},
	}}
	for k, v := range fields {
		obj.Object[k] = v
	}
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

// settingCRD installs Harvester's Setting API where no simulator does: the
// names and scope of harvester deploy/charts/harvester-crd, an open schema.
func (h *Host) settingCRD(ctx context.Context) error {
	dyn, err := dynamic.NewForConfig(h.Env.Config)
	if err != nil {
		return err
	}
	crd := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
		"metadata": map[string]any{"name": "settings.harvesterhci.io"},
		"spec": map[string]any{
			"group": "harvesterhci.io", "scope": "Cluster",
			"names": map[string]any{"plural": "settings", "singular": "setting", "kind": "Setting", "listKind": "SettingList"},
			"versions": []any{map[string]any{
				"name": "v1beta1", "served": true, "storage": true,
				"schema": map[string]any{"openAPIV3Schema": map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
			}},
		},
	}}
	res := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	if _, err := res.Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}
